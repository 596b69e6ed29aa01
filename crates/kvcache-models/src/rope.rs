//! Rotary position embeddings, one [`Rope`] for both models and both backends:
//! the frequencies and the `cos`/`sin` tables in f64 rounded to f32 (what the
//! mlx models use too), the rotation on candle tensors, in either pairing of
//! dimensions ([`RopeLayout`]: the Llama's interleaved pairs, Gemma's halves).

use std::sync::Arc;

use candle_core::{Device, Tensor};
use kvcache_api::{KeyShift, Pos};
use kvcache_causal::RopeLayout;

use crate::error::to_cache_err;
use crate::{ModelError, Result};

/// RoPE over heads of `head_dim` dimensions: pair `i` of each head rotates by
/// `pos * base^(-2i / head_dim)`. [`RopeLayout::Normal`] pairs dimensions
/// `(2i, 2i + 1)` (GGUF's layout for the Llama, `candle_nn::rotary_emb::rope_i`
/// semantics), [`RopeLayout::NeoX`] `(i, i + head_dim / 2)` (Gemma's).
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Arc<[f64]>,
    layout: RopeLayout,
}

impl Rope {
    /// RoPE in the interleaved layout for heads of `head_dim` dimensions with
    /// frequency base `base`.
    pub fn new(head_dim: usize, base: f64) -> Self {
        Rope::with_layout(RopeLayout::Normal, head_dim, base)
    }

    /// RoPE in `layout` for heads of `head_dim` dimensions with frequency base `base`.
    pub fn with_layout(layout: RopeLayout, head_dim: usize, base: f64) -> Self {
        let inv_freq = (0..head_dim / 2)
            .map(|i| 1.0 / base.powf(2.0 * i as f64 / head_dim as f64))
            .collect();
        Rope { inv_freq, layout }
    }

    /// How dimensions are paired.
    pub fn layout(&self) -> RopeLayout {
        self.layout
    }

    /// The head width it rotates.
    pub fn head_dim(&self) -> usize {
        2 * self.inv_freq.len()
    }

    /// Rotates `x: [n, heads, head_dim]`, row `i` by `positions[i]` (any integer,
    /// negative ones rotate back). Returns the same shape.
    pub fn apply(&self, x: &Tensor, positions: &[Pos]) -> Result<Tensor> {
        let tables = self.tables(positions, x.device())?;
        self.apply_tables(x, &tables)
    }

    /// `cos` and `sin` of every (position, frequency) pair, position-major,
    /// computed in f64 and rounded to f32: the numbers every backend rotates by.
    pub fn cos_sin(&self, positions: impl IntoIterator<Item = Pos>) -> (Vec<f32>, Vec<f32>) {
        let positions = positions.into_iter();
        let len = positions.size_hint().0 * self.inv_freq.len();
        let (mut cos, mut sin) = (Vec::with_capacity(len), Vec::with_capacity(len));
        for p in positions {
            for &f in self.inv_freq.iter() {
                let angle = f64::from(p) * f;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        (cos, sin)
    }

    /// `cos` and `sin` of every (position, frequency) pair for
    /// [`apply_tables`](Self::apply_tables): `[n, 1, head_dim / 2, 1]` each in
    /// the interleaved layout, `[n, 1, 1, head_dim / 2]` over halves.
    pub fn tables(&self, positions: &[Pos], device: &Device) -> Result<(Tensor, Tensor)> {
        let (n, half) = (positions.len(), self.inv_freq.len());
        let (cos, sin) = self.cos_sin(positions.iter().copied());
        let shape = match self.layout {
            RopeLayout::Normal => (n, 1, half, 1),
            RopeLayout::NeoX => (n, 1, 1, half),
        };
        Ok((
            Tensor::from_vec(cos, shape, device)?,
            Tensor::from_vec(sin, shape, device)?,
        ))
    }

    /// Rotates `x: [n, heads, head_dim]` with tables from [`tables`](Self::tables).
    pub fn apply_tables(&self, x: &Tensor, (cos, sin): &(Tensor, Tensor)) -> Result<Tensor> {
        let (n, heads, head_dim) = x.dims3()?;
        let half = head_dim / 2;
        if half != self.inv_freq.len() || cos.dim(0)? != n {
            return Err(ModelError::InvalidArgument(format!(
                "rope: x {:?} with {} positions and head dim {}",
                x.dims(),
                cos.dim(0)?,
                self.head_dim()
            )));
        }
        let cos = cos.to_dtype(x.dtype())?;
        let sin = sin.to_dtype(x.dtype())?;
        // The two members of each pair along `axis`.
        let (x, axis) = match self.layout {
            RopeLayout::Normal => (x.reshape((n, heads, half, 2))?, 3),
            RopeLayout::NeoX => (x.reshape((n, heads, 2, half))?, 2),
        };
        let x0 = x.narrow(axis, 0, 1)?;
        let x1 = x.narrow(axis, 1, 1)?;
        let o0 = (x0.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
        let o1 = (x0.broadcast_mul(&sin)? + x1.broadcast_mul(&cos)?)?;
        Ok(Tensor::cat(&[o0, o1], axis)?.reshape((n, heads, head_dim))?)
    }
}

/// Re-rotates cached keys after a shifting removal: `keys: [n, kv_heads, head_dim]`
/// rotated by `shifts[i]` positions (RoPE composes: `R(p) R(d) = R(p + d)`).
impl KeyShift<Tensor> for Rope {
    fn shift(&self, _layer: usize, keys: &Tensor, shifts: &[Pos]) -> kvcache_api::Result<Tensor> {
        self.apply(keys, shifts).map_err(|e| match e {
            ModelError::Candle(c) => to_cache_err(c),
            other => kvcache_api::CacheError::InvalidArgument(other.to_string()),
        })
    }
}
