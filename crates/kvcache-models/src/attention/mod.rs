//! Attention over a causal cache: the dense reference and paged kernels whose
//! cost is what each row sees.
//!
//! [`CausalCache::get`] hands a model every cell of the pass's range and a
//! dense `[rows, cells]` mask: `q kᵀ` then costs rows x range whatever a row
//! may see (16 sequences decoding side by side each score all 16 sequences'
//! cells and mask away 15 of them), and `q8_0` storage is decoded to f32 over
//! the whole range first. [`CausalCache::get_paged`] hands it instead each
//! row's visible cells as sorted runs ([`RowRuns`](kvcache_api::RowRuns)) and
//! the layer's keys and values as stored ([`StoredKv`](kvcache_api::StoredKv));
//! the paged kernels walk those runs and read only the cells seen, in their
//! stored type.
//!
//! Shapes: queries `[n, n_heads, head_dim]` (f32), query head `j * g + i`
//! using key/value head `j` (`g = n_heads / kv_heads`); keys `[cells, kv_heads,
//! head_dim]`, values `[cells, kv_heads, head_dim_v]` or, with
//! [`VLayout::Permuted`], `[kv_heads, head_dim_v, cells]`, read through their
//! layout (start offset and strides), as f32, f16, bf16 or `q8_0` (integers
//! `q + 128` and one f16 scale per 32 values of a head); the output is
//! `[n, n_heads * head_dim_v]`.
//!
//! - `stored`: what every kernel checks and reads of the view, on any device:
//!   the stored type, the axes and strides of keys and values, and the shapes
//!   that must agree.
//! - [`paged_attention`] (`cpu`): the CPU kernel, FlashAttention-2 style over
//!   tiles of 64 cells, parallel over blocks of rows and key/value heads.
//! - [`device`]: the CUDA kernel (one thread block per row and key/value
//!   head; only the run lists cross the bus) and [`device::PagedLaunch`], the
//!   arguments it is given, built on any device.
//!
//! `cached_attention` is the glue both models run in their cached forward
//! pass: `put`, then the paged view where the [`AttentionPath`] asks for it and
//! the cache and device allow, else `get` and `dense_attention`.

use candle_core::{DType, Tensor};
use kvcache_api::{CacheError, CausalCache, PagedKv, VLayout};

use crate::kernels;
use crate::{ModelError, Result};

mod cpu;
pub mod device;
mod stored;

pub use cpu::paged_attention;

/// How a model's cached forward pass computes attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionPath {
    /// [`CausalCache::get_paged`]'s runs walked by a paged kernel
    /// ([`paged_attention`] on the CPU, [`device`]'s on CUDA with the `cuda`
    /// feature): cost follows the cells each row sees. Falls back to
    /// [`Dense`](Self::Dense) where the cache answers
    /// [`CacheError::NotSupported`], the device has no paged kernel, or the
    /// kernel does not take the shapes.
    #[default]
    Paged,
    /// [`CausalCache::get`]'s keys and values over the pass's whole cell range
    /// under the dense mask: the reference.
    Dense,
}

/// What one layer attends over: keys and values `[cells, kv_heads, head_dim]`
/// (values `[kv_heads, head_dim, cells]` when `permuted`) under `mask: [n, cells]`
/// (0 visible, `-inf` hidden).
#[derive(Debug, Clone)]
pub struct Attend {
    /// Keys, `[cells, kv_heads, head_dim]`.
    pub keys: Tensor,
    /// Values, `[cells, kv_heads, head_dim]`, or `[kv_heads, head_dim, cells]` when `permuted`.
    pub values: Tensor,
    /// `[n, cells]`.
    pub mask: Tensor,
    /// The values' layout.
    pub permuted: bool,
}

/// Dense attention: `q: [n, n_heads, head_dim]` over every cell of `ctx` under
/// its mask, query head `j * g + i` using key/value head `j`; returns
/// `[n, n_heads * head_dim_v]`.
pub(crate) fn dense_attention(q: &Tensor, ctx: &Attend, scale: f32) -> Result<Tensor> {
    let (n, h, hd) = q.dims3()?;
    let kvh = ctx.keys.dim(1)?;
    if kvh == 0 || h % kvh != 0 {
        return Err(ModelError::InvalidArgument(format!(
            "{h} query heads over {kvh} key/value heads"
        )));
    }
    let g = h / kvh;
    // Query head j * g + i uses key/value head j.
    let q = q
        .reshape((n, kvh, g, hd))?
        .permute((1, 2, 0, 3))?
        .reshape((kvh, g * n, hd))?;
    // Strided views go to the matmul as they are: `gemm` reads any strides, and
    // a copy of every cached key and value per layer cost more than the products.
    let kt = ctx.keys.permute((1, 2, 0))?; // [kvh, hd, cells]
    let scores = q.matmul(&kt)?; // [kvh, g * n, cells]
    let probs = kernels::masked_softmax(&scores, &ctx.mask, scale)?;
    let v = if ctx.permuted {
        ctx.values.transpose(1, 2)? // [kvh, hdv, cells] -> [kvh, cells, hdv]
    } else {
        ctx.values.transpose(0, 1)? // [cells, kvh, hdv] -> [kvh, cells, hdv]
    };
    let out = probs.matmul(&v)?; // [kvh, g * n, hdv]
    let hdv = out.dim(2)?;
    Ok(out
        .reshape((kvh, g, n, hdv))?
        .permute((2, 0, 1, 3))?
        .reshape((n, h * hdv))?)
}

/// One layer's attention in a cached forward pass (after `start_forward`):
/// `set_layer(layer)`, `put(k, v)`, then with [`AttentionPath::Paged`]
/// [`get_paged`](CausalCache::get_paged) and the paged kernel of the device;
/// where the cache answers [`CacheError::NotSupported`] (or the path is
/// [`Dense`](AttentionPath::Dense), or no paged kernel takes it) `get` and
/// [`dense_attention`]. `q: [n, n_heads, head_dim]`, `k` and `v: [n, kv_heads,
/// head_dim]`; returns `[n, n_heads * head_dim_v]`.
pub(crate) fn cached_attention<C>(
    cache: &mut C,
    path: AttentionPath,
    layer: usize,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
) -> Result<Tensor>
where
    C: CausalCache<Tensor = Tensor> + ?Sized,
{
    cache.set_layer(layer);
    cache.put(k, v)?;
    if path == AttentionPath::Paged && has_paged_kernel(q) {
        match cache.get_paged() {
            Ok(view) => {
                let q = q.to_dtype(DType::F32)?;
                if let Some(out) = paged_kernel(&q, &view, scale)? {
                    return Ok(out);
                }
            }
            Err(CacheError::NotSupported(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let n = q.dim(0)?;
    let permuted = cache.config().v_layout == VLayout::Permuted;
    let view = cache.get()?;
    let ctx = Attend {
        keys: view.keys.to_dtype(DType::F32)?,
        values: view.values.to_dtype(DType::F32)?,
        mask: view.mask.narrow(0, 0, n)?.to_dtype(DType::F32)?,
        permuted,
    };
    dense_attention(q, &ctx, scale)
}

/// Whether a paged kernel runs where `q` lives: the CPU, and CUDA when built
/// with the `cuda` feature.
fn has_paged_kernel(q: &Tensor) -> bool {
    q.device().is_cpu() || (cfg!(feature = "cuda") && q.device().is_cuda())
}

/// The paged kernel of `q`'s device: `Ok(None)` where none takes the view.
fn paged_kernel(q: &Tensor, view: &PagedKv<'_, Tensor>, scale: f32) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        return device::paged_attention_cuda(q, view, scale);
    }
    paged_attention(q, view, scale)
}
