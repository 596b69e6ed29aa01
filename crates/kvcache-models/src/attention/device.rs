//! Paged attention on a GPU: the CUDA kernel ([`PAGED_ATTENTION_CU`]) and the
//! arguments it is given ([`PagedLaunch`]).
//!
//! The kernel runs one thread block per query row and key/value head. The
//! block walks the row's visible cells in tiles of [`THREADS`] cells (each
//! thread finds its cell in the row's runs and scores it against the query
//! heads of the group), keeps a running maximum and sum per query head
//! (online softmax), and each thread adds up a slice of the head dimension
//! of the values. Keys and values are read in their stored type, `q8_0`
//! decoded per 32-value block as it is read. The source's header says the
//! rest.
//!
//! What crosses the bus per launch is [`PagedLaunch::runs`] (the CSR run lists
//! and each run's running count of visible cells: O(runs), never rows x
//! cells) and [`KernelArgs`] (a few strides); queries, keys and values stay
//! on the device. [`PagedLaunch`] is plain Rust, built from a paged view on
//! any device, so the engine's tests build it on the CPU and run the kernel's
//! source there through a small host shim (`tests/cuda_on_cpu`), checking it
//! against the CPU kernel where no GPU is at hand.
//!
//! With the `cuda` feature, `paged_attention_cuda` launches it (PTX built by
//! `build.rs` with `nvcc`); the models use it on a CUDA device by default.

use candle_core::Tensor;
use kvcache_api::PagedKv;

use super::stored::{Geometry, StoredShape, StoredType};
use crate::Result;

/// The CUDA kernel's source, `cuda/paged_attention.cu`: four entry points,
/// one per stored type ([`KernelType::entry`]).
pub const PAGED_ATTENTION_CU: &str = include_str!("../../cuda/paged_attention.cu");

/// Threads per block the kernel is built with (its `PA_THREADS`), and cells
/// per tile.
pub const THREADS: u32 = 128;

/// Most query heads per key/value head the kernel takes (`PA_MAX_GROUP`).
pub const MAX_GROUP: usize = 8;

/// Longest key or value head the kernel takes (`PA_MAX_DIM`).
pub const MAX_HEAD_DIM: usize = 256;

/// The stored type a kernel entry point reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelType {
    /// f32 keys and values.
    F32,
    /// f16.
    F16,
    /// bf16.
    BF16,
    /// `q8_0`: `u8` quants and f16 scales.
    Q8_0,
}

impl KernelType {
    /// The kernel's entry point for this type.
    pub fn entry(self) -> &'static str {
        match self {
            KernelType::F32 => "paged_attention_f32",
            KernelType::F16 => "paged_attention_f16",
            KernelType::BF16 => "paged_attention_bf16",
            KernelType::Q8_0 => "paged_attention_q8_0",
        }
    }

    /// The type's number in the source (`PA_F32` ... `PA_Q8_0`).
    pub fn code(self) -> u32 {
        match self {
            KernelType::F32 => 0,
            KernelType::F16 => 1,
            KernelType::BF16 => 2,
            KernelType::Q8_0 => 3,
        }
    }
}

/// Where the kernel finds element `(cell, head, d)` of stored keys or values:
/// `start + cell * cell + head * head + d * dim` elements into their storage;
/// `q8_0` scales likewise, `d / 32` along the dimension. The source's
/// `PaStored`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoredArgs {
    /// First element.
    pub start: i64,
    /// Stride between cells.
    pub cell: i64,
    /// Stride between heads.
    pub head: i64,
    /// Stride along the head dimension.
    pub dim: i64,
    /// The scales' first element (0 for float storage).
    pub scales_start: i64,
    /// The scales' stride between cells.
    pub scales_cell: i64,
    /// The scales' stride between heads.
    pub scales_head: i64,
    /// The scales' stride between 32-value blocks.
    pub scales_dim: i64,
}

/// The kernel's scalar arguments, passed by value: the source's `PaArgs`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KernelArgs {
    /// Query rows (grid x).
    pub rows: u32,
    /// Query heads.
    pub n_heads: u32,
    /// Key/value heads (grid y).
    pub kv_heads: u32,
    /// Query heads per key/value head.
    pub group: u32,
    /// Query and key head dimension.
    pub head_dim: u32,
    /// Value head dimension.
    pub head_dim_v: u32,
    /// Runs in all rows.
    pub runs: u32,
    /// Scores are `q · k * scale`.
    pub scale: f32,
    /// The keys.
    pub keys: StoredArgs,
    /// The values.
    pub values: StoredArgs,
}

impl KernelArgs {
    /// The arguments as the bytes the kernel receives.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: `KernelArgs` is `repr(C)` of 4-byte fields followed by
        // 8-byte ones, 8 + 8 of each kind: no padding, every byte initialized.
        unsafe { std::slice::from_raw_parts((self as *const Self).cast::<u8>(), std::mem::size_of::<Self>()) }
    }
}

/// One launch of the kernel for a paged view: which entry point, its scalar
/// arguments and the run lists it walks. Built on any device.
#[derive(Debug, Clone, PartialEq)]
pub struct PagedLaunch {
    ty: KernelType,
    args: KernelArgs,
    runs: Vec<u32>,
}

impl PagedLaunch {
    /// The launch for `q: [n, n_heads, head_dim]` (f32) attending through
    /// `view` with scores scaled by `scale`; `Ok(None)` where the kernel does
    /// not take the shapes (more than [`MAX_GROUP`] query heads per key/value
    /// head, a head longer than [`MAX_HEAD_DIM`], keys and values stored in
    /// different types, counts past `u32`): attend densely instead.
    ///
    /// # Errors
    /// [`ModelError::InvalidArgument`](crate::ModelError::InvalidArgument) for the shapes and types
    /// [`paged_attention`](super::paged_attention) refuses.
    pub fn new(q: &Tensor, view: &PagedKv<'_, Tensor>, scale: f32) -> Result<Option<PagedLaunch>> {
        let geometry = Geometry::of(q, view)?;
        let Geometry {
            n,
            n_heads,
            kv_heads,
            group,
            head_dim,
            head_dim_v,
            keys,
            values,
        } = geometry;
        if keys.ty != values.ty || group > MAX_GROUP || head_dim > MAX_HEAD_DIM || head_dim_v > MAX_HEAD_DIM {
            return Ok(None);
        }
        let ty = match keys.ty {
            StoredType::F32 => KernelType::F32,
            StoredType::F16 => KernelType::F16,
            StoredType::BF16 => KernelType::BF16,
            StoredType::Q8_0 => KernelType::Q8_0,
        };
        let runs = view.runs;
        let Some(runs_words) = (2 * n + 1).checked_add(2 * runs.runs().len()) else {
            return Ok(None);
        };
        let (Ok(rows), Ok(run_count), Ok(_)) = (
            u32::try_from(n),
            u32::try_from(runs.runs().len()),
            u32::try_from(runs_words),
        ) else {
            return Ok(None);
        };
        let (Some(keys_args), Some(values_args)) = (stored_args(&keys), stored_args(&values)) else {
            return Ok(None);
        };
        // offsets[rows + 1] | visible[rows] | starts[runs] | before[runs]
        let mut words = Vec::with_capacity(runs_words);
        words.extend_from_slice(runs.offsets());
        words.extend((0..n).map(|r| runs.visible(r) as u32));
        words.extend(runs.runs().iter().map(|run| run.start));
        for r in 0..n {
            let mut before = 0u32;
            for run in runs.row(r) {
                words.push(before);
                before += run.end - run.start;
            }
        }
        debug_assert_eq!(words.len(), runs_words);
        let narrow = |x: usize| u32::try_from(x).expect("head counts and dimensions checked small");
        Ok(Some(PagedLaunch {
            ty,
            args: KernelArgs {
                rows,
                n_heads: narrow(n_heads),
                kv_heads: narrow(kv_heads),
                group: narrow(group),
                head_dim: narrow(head_dim),
                head_dim_v: narrow(head_dim_v),
                runs: run_count,
                scale,
                keys: keys_args,
                values: values_args,
            },
            runs: words,
        }))
    }

    /// The stored type, hence the entry point.
    pub fn kernel_type(&self) -> KernelType {
        self.ty
    }

    /// The scalar arguments.
    pub fn args(&self) -> &KernelArgs {
        &self.args
    }

    /// The run lists as the kernel reads them, one `u32` buffer:
    /// `offsets[rows + 1]` (row `r`'s runs are `offsets[r]..offsets[r + 1]`),
    /// `visible[rows]` (cells each row sees), `starts[runs]` (each run's first
    /// cell) and `before[runs]` (the cells of its row before it). All that
    /// crosses the bus besides [`args`](Self::args).
    pub fn runs(&self) -> &[u32] {
        &self.runs
    }

    /// The grid: one block per query row and key/value head.
    pub fn grid(&self) -> (u32, u32) {
        (self.args.rows, self.args.kv_heads)
    }

    /// The output's shape, `[rows, n_heads * head_dim_v]` (f32).
    pub fn out_dims(&self) -> (usize, usize) {
        (
            self.args.rows as usize,
            (self.args.n_heads * self.args.head_dim_v) as usize,
        )
    }
}

/// `shape`'s strides as the kernel's arguments; `None` past `i64`.
fn stored_args(shape: &StoredShape) -> Option<StoredArgs> {
    let i = |x: usize| i64::try_from(x).ok();
    let s = shape.scales_at;
    Some(StoredArgs {
        start: i(shape.at.start)?,
        cell: i(shape.at.cell)?,
        head: i(shape.at.head)?,
        dim: i(shape.at.dim)?,
        scales_start: i(s.map_or(0, |s| s.start))?,
        scales_cell: i(s.map_or(0, |s| s.cell))?,
        scales_head: i(s.map_or(0, |s| s.head))?,
        scales_dim: i(s.map_or(0, |s| s.dim))?,
    })
}

// The source's `PaArgs`: seven `unsigned` and a `float`, then two `PaStored`
// of eight `long long`.
const _: () = assert!(std::mem::size_of::<KernelArgs>() == 32 + 2 * 64);

#[cfg(feature = "cuda")]
pub use cuda::paged_attention_cuda;

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaStorage, WrapErr};
    use candle_core::{CpuStorage, CustomOp1, Device, Layout, Shape, Storage, StorageRef, Tensor};
    use half::{bf16, f16};
    use kvcache_api::{PagedKv, StoredKv};

    use super::super::stored::all_on;
    use super::{KernelArgs, KernelType, PagedLaunch, THREADS};
    use crate::Result;

    /// The kernel built for the GPU by `build.rs`.
    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/paged_attention.ptx"));

    // SAFETY: `KernelArgs` is `repr(C)` plain data matching the source's `PaArgs`.
    unsafe impl DeviceRepr for KernelArgs {}

    /// [`paged_attention`](crate::attention::paged_attention) on a CUDA device,
    /// through the kernel: `Ok(None)` where a tensor is not on CUDA or the
    /// kernel does not take the shapes ([`PagedLaunch::new`]).
    ///
    /// # Errors
    /// [`ModelError::InvalidArgument`](crate::ModelError::InvalidArgument)
    /// as `paged_attention`'s; a launch that fails, as a candle error.
    pub fn paged_attention_cuda(
        q: &Tensor,
        view: &PagedKv<'_, Tensor>,
        scale: f32,
    ) -> Result<Option<Tensor>> {
        if !all_on(q, view, Device::is_cuda) {
            return Ok(None);
        }
        let Some(launch) = PagedLaunch::new(q, view, scale)? else {
            return Ok(None);
        };
        if launch.args.rows == 0 {
            let (n, width) = launch.out_dims();
            return Ok(Some(Tensor::zeros(
                (n, width),
                candle_core::DType::F32,
                q.device(),
            )?));
        }
        let op = Launch {
            launch,
            keys: view.keys.clone(),
            values: view.values.clone(),
        };
        Ok(Some(q.contiguous()?.apply_op1_no_bwd(&op)?))
    }

    /// The launch as a candle operation on the queries (keys and values held).
    struct Launch {
        launch: PagedLaunch,
        keys: StoredKv<Tensor>,
        values: StoredKv<Tensor>,
    }

    impl CustomOp1 for Launch {
        fn name(&self) -> &'static str {
            "kvcache-paged-attention"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
            candle_core::bail!("the CUDA paged attention ran on the CPU: use attention::paged_attention")
        }

        fn cuda_fwd(&self, q: &CudaStorage, q_layout: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
            let dev = q.device().clone();
            let ty = self.launch.ty;
            let func = dev.get_or_load_custom_func(ty.entry(), "kvcache_paged_attention", PTX)?;
            let q_all = q.as_cuda_slice::<f32>()?;
            let q = q_all.slice(q_layout.start_offset()..);
            let runs = dev.clone_htod(self.launch.runs.as_slice())?;
            let (n, width) = self.launch.out_dims();
            let out = dev.alloc_zeros::<f32>(n * width)?;
            let (k_data, v_data) = (held(self.keys.data()), held(self.values.data()));
            let (k_scales, v_scales) = (held_scales(&self.keys), held_scales(&self.values));
            let (k, v) = (on_cuda(&k_data)?, on_cuda(&v_data)?);
            let ks = k_scales.as_deref().map(on_cuda).transpose()?;
            let vs = v_scales.as_deref().map(on_cuda).transpose()?;
            let null = 0u64;
            let mut b = func.builder();
            b.arg(&q);
            arg_stored(&mut b, ty, k, ks, &null)?;
            arg_stored(&mut b, ty, v, vs, &null)?;
            b.arg(&runs);
            b.arg(&out);
            b.arg(&self.launch.args);
            let (rows, kv_heads) = self.launch.grid();
            let cfg = LaunchConfig {
                grid_dim: (rows, kv_heads, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments are the source's, in its order and types;
            // `PagedLaunch::new` checked every run against the stored cells and
            // the strides against the tensors' layouts, which candle keeps
            // within their storage.
            unsafe { b.launch(cfg) }.w()?;
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((n, width))))
        }
    }

    /// Pushes stored keys or values, `data` in the kernel's type `ty`, then
    /// their `q8_0` scales (`null` for float storage), as the kernel takes them.
    fn arg_stored<'a>(
        b: &mut LaunchArgs<'a>,
        ty: KernelType,
        data: &'a CudaStorage,
        scales: Option<&'a CudaStorage>,
        null: &'a u64,
    ) -> candle_core::Result<()> {
        match ty {
            KernelType::F32 => b.arg(data.as_cuda_slice::<f32>()?),
            KernelType::F16 => b.arg(data.as_cuda_slice::<f16>()?),
            KernelType::BF16 => b.arg(data.as_cuda_slice::<bf16>()?),
            KernelType::Q8_0 => b.arg(data.as_cuda_slice::<u8>()?),
        };
        match scales {
            Some(s) => b.arg(s.as_cuda_slice::<f16>()?),
            None => b.arg(null),
        };
        Ok(())
    }

    /// The storage of `t`, held while the kernel is launched.
    fn held(t: &Tensor) -> StorageRef<'_> {
        t.storage_and_layout().0
    }

    /// The storage of `q8_0` scales, held; `None` for float storage.
    fn held_scales(stored: &StoredKv<Tensor>) -> Option<StorageRef<'_>> {
        match stored {
            StoredKv::Q8_0 { scales, .. } => Some(held(scales)),
            StoredKv::Float(_) => None,
        }
    }

    fn on_cuda(storage: &Storage) -> candle_core::Result<&CudaStorage> {
        match storage {
            Storage::Cuda(c) => Ok(c),
            _ => candle_core::bail!("paged attention: keys or values left the GPU"),
        }
    }
}
