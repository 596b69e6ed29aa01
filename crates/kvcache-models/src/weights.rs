//! The candle models' weights, written once for the Llama and Gemma: how they
//! are held ([`WeightMode`]), the matrix type ([`Linear`]: dense f32 or
//! quantized, the dense product's kernel chosen per model, [`DenseKernel`]),
//! what a model asks for (a [`WeightSpec`]: GGUF name, shape and how a test
//! weight is drawn) and where the weights come from as a model is built
//! ([`WeightSource`]: a GGUF file's tensors, [`GgufWeights`], or seeded
//! pseudo-random ones for tests, [`RandomWeights`]). The mlx models draw
//! their random weights from the same specs, so each backend's random model
//! holds the other's numbers. What the models build of them is in
//! [`crate::decoder`].

mod skinny;

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};

use crate::gguf::Tensors;
use crate::quant::{default_isa, Format, GgmlType, QActivations, QMatrix, Spread, Target};
use crate::{ModelError, Result};

/// How the weights are held in memory and multiplied: one choice for every
/// matrix of a model (norms and the embedding lookup stay in f32).
///
/// The prefix store's fingerprint includes the mode: keys and values computed
/// under one mode are never reused under another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum WeightMode {
    /// Every weight dequantized to f32 and multiplied in f32 (the reference:
    /// the equivalence tests' tightest tolerances hold here).
    #[default]
    F32,
    /// The GGUF's own blocks multiplied by candle's quantized kernels
    /// (`QMatMul`; Q4_1 has no fast CPU kernel there).
    Candle,
    /// Every matrix in 8-bit blocks (`quant::Format::Q8`, the values of ggml's
    /// Q8_0: exact for Q8_0 and Q5_0 files, requantized from anything else),
    /// multiplied by [`crate::quant`]'s kernels against activations quantized
    /// per row. CPU only.
    Q8,
    /// Every matrix in 4-bit blocks (`quant::Format::Q4`, the values of ggml's
    /// Q4_1: exact for Q4_0 and Q4_1, Q4_K within its scales' f16 rounding,
    /// requantized from anything else, the 8-bit output heads included).
    /// CPU only.
    Q4,
    /// The file's own blocks where [`crate::quant`] multiplies them (Q4_0,
    /// Q4_1, Q4_K as 4-bit; Q8_0 and Q5_0 as 8-bit), 8-bit for the rest (Q6_K,
    /// floats): the bytes per token of llama.cpp on the same file. CPU only.
    Gguf,
}

impl WeightMode {
    /// Every mode, the reference first.
    pub const ALL: [WeightMode; 5] = [
        WeightMode::F32,
        WeightMode::Candle,
        WeightMode::Q8,
        WeightMode::Q4,
        WeightMode::Gguf,
    ];

    /// What programs use when the user names none: the fastest mode whose
    /// results keep the equivalence proofs (see docs/BENCHMARKS.md, E9).
    pub const FASTEST: WeightMode = WeightMode::Gguf;

    /// The mode programs use on `device` when the user names none:
    /// [`FASTEST`](Self::FASTEST) on the CPU; elsewhere
    /// [`Candle`](Self::Candle), the GGUF's own blocks multiplied by candle's
    /// quantized kernels for that device (the packed modes run on the CPU
    /// only).
    pub fn fastest_on(device: &Device) -> WeightMode {
        if device.is_cpu() {
            Self::FASTEST
        } else {
            WeightMode::Candle
        }
    }

    /// The mode's name on command lines (`f32`, `candle`, `q8`, `q4`, `gguf`).
    pub fn name(self) -> &'static str {
        match self {
            WeightMode::F32 => "f32",
            WeightMode::Candle => "candle",
            WeightMode::Q8 => "q8",
            WeightMode::Q4 => "q4",
            WeightMode::Gguf => "gguf",
        }
    }

    /// The block format matrices are converted to, for the modes
    /// [`crate::quant`] multiplies.
    fn packed(self) -> Option<Target> {
        match self {
            WeightMode::F32 | WeightMode::Candle => None,
            WeightMode::Q8 => Some(Target::Q8),
            WeightMode::Q4 => Some(Target::Q4),
            WeightMode::Gguf => Some(Target::AsStored),
        }
    }

    /// An `InvalidArgument` error when the mode cannot hold weights on
    /// `device` ([`crate::quant`]'s modes run on the CPU only).
    pub fn check_device(self, device: &Device) -> Result<()> {
        if self.packed().is_some() && !device.is_cpu() {
            return Err(ModelError::InvalidArgument(format!(
                "weights {} run on the CPU only: use f32 or candle on this device",
                self.name()
            )));
        }
        Ok(())
    }
}

impl std::fmt::Display for WeightMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for WeightMode {
    type Err = ModelError;

    /// A mode by its [`name`](WeightMode::name) (`quantized` is `candle`'s
    /// older name).
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim().to_ascii_lowercase();
        if s == "quantized" || s == "q" {
            return Ok(WeightMode::Candle);
        }
        WeightMode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = WeightMode::ALL.iter().map(|m| m.name()).collect();
                ModelError::InvalidArgument(format!("no weight mode {s:?}: one of {}", names.join(", ")))
            })
    }
}

/// How a dense (f32) [`Linear`] multiplies: each model's measured choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DenseKernel {
    /// candle's matmul (`gemm`) for any number of rows.
    Gemm,
    /// Up to 16 rows (decode steps) through a kernel that streams each weight
    /// row once for all rows ([`skinny::forward`]), f32 on the CPU; more rows,
    /// or other devices and types, through `gemm`.
    FewRows,
}

/// A weight matrix `[out, in]` applied as `x @ W^T` (dense: the transposed view
/// goes to the matmul as is; storing `W^T` contiguous measured no better).
#[derive(Debug, Clone)]
pub(crate) enum Linear {
    /// f32 weights, multiplied by the kernel named.
    Dense(Tensor, DenseKernel),
    /// GGUF-quantized weights, multiplied by candle's quantized kernels.
    Quant(QMatMul),
    /// Weights in [`crate::quant`]'s blocks (shared: a model's copies hold
    /// one), multiplied against activations quantized per row.
    Packed(Arc<QMatrix>),
}

impl Linear {
    /// A GGUF matrix `q`, dequantized to f32 on `device` or kept quantized as
    /// `mode` says; dense products through `kernel`.
    pub(crate) fn new(q: QTensor, mode: WeightMode, kernel: DenseKernel, device: &Device) -> Result<Self> {
        Ok(match (mode, mode.packed()) {
            (_, Some(target)) => Linear::Packed(Arc::new(packed_from_qtensor(&q, target)?)),
            (WeightMode::Candle, None) => Linear::Quant(QMatMul::from_qtensor(q)?),
            _ => Linear::Dense(q.dequantize(device)?, kernel),
        })
    }

    /// An f32 matrix `w` (`[out, in]`) held as `mode` says: random test
    /// weights, or a tied output head without a stored copy.
    pub(crate) fn from_f32(w: Tensor, mode: WeightMode, kernel: DenseKernel) -> Result<Self> {
        Ok(match (mode, mode.packed()) {
            (_, Some(target)) => {
                let (rows, cols) = w.dims2()?;
                let values = w.flatten_all()?.to_vec1::<f32>()?;
                let format = match target {
                    Target::Q4 => Format::Q4,
                    Target::Q8 | Target::AsStored => Format::Q8,
                };
                let q = QMatrix::quantize(format, rows, cols, &values).map_err(format_error)?;
                Linear::Packed(Arc::new(q))
            }
            (WeightMode::Candle, None) => {
                Linear::Quant(QMatMul::from_qtensor(QTensor::quantize(&w, GgmlDType::Q8_0)?)?)
            }
            _ => Linear::Dense(w, kernel),
        })
    }

    /// The output projection tied to the embedding: with quantized weights
    /// the embedding as the file stores it (`stored`), else `embed`, the
    /// embedding in f32 (shared, not copied).
    pub(crate) fn tied(
        embed: &Tensor,
        stored: Option<QTensor>,
        mode: WeightMode,
        kernel: DenseKernel,
    ) -> Result<Self> {
        Ok(match (mode, stored) {
            (WeightMode::F32, _) => Linear::Dense(embed.clone(), kernel),
            (_, Some(q)) => Linear::new(q, mode, kernel, embed.device())?,
            (_, None) => Linear::from_f32(embed.clone(), mode, kernel)?,
        })
    }

    /// Bytes of weights one product reads, in the type they are held in.
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Linear::Dense(w, _) => w.elem_count() * w.dtype().size_in_bytes(),
            Linear::Quant(QMatMul::QTensor(q)) => q.storage_size_in_bytes(),
            Linear::Quant(QMatMul::Tensor(w) | QMatMul::TensorF16(w)) => {
                w.elem_count() * w.dtype().size_in_bytes()
            }
            Linear::Packed(w) => w.weight_bytes(),
        }
    }

    /// `x: [n, in]` to `[n, out]`.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Linear::Dense(w, DenseKernel::FewRows) => match skinny::forward(x, w)? {
                Some(y) => y,
                None => x.matmul(&w.t()?)?,
            },
            Linear::Dense(w, DenseKernel::Gemm) => x.matmul(&w.t()?)?,
            Linear::Quant(q) => q.forward(x)?,
            Linear::Packed(w) => packed_forward(w, x)?,
        })
    }
}

/// `x: [n, in]` through each of `linears` (sharing their input: a layer's
/// query, key and value projections, its gate and up): where all are packed,
/// `x` is quantized once and the products run in one parallel section
/// ([`QMatrix::matmul_many_on`]); otherwise one [`Linear::forward`] each.
pub(crate) fn forward_shared<const N: usize>(linears: [&Linear; N], x: &Tensor) -> Result<[Tensor; N]> {
    let packed: Option<Vec<&QMatrix>> = linears
        .iter()
        .map(|l| match l {
            Linear::Packed(w) => Some(&**w),
            _ => None,
        })
        .collect();
    let Some(ws) = packed else {
        let mut out = Vec::with_capacity(N);
        for l in linears {
            out.push(l.forward(x)?);
        }
        return Ok(out.try_into().expect("one output per matrix"));
    };
    let (n, x, acts) = quantized_rows(x, &ws)?;
    let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![0f32; n * w.rows()]).collect();
    {
        let mut slices: Vec<&mut [f32]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
        QMatrix::matmul_many_on(&ws, &acts, default_isa(), &mut slices, &CandlePool)
            .map_err(|e| ModelError::InvalidArgument(e.to_string()))?;
    }
    let mut tensors = Vec::with_capacity(N);
    for (out, w) in outs.into_iter().zip(&ws) {
        tensors.push(Tensor::from_vec(out, (n, w.rows()), x.device())?);
    }
    Ok(tensors.try_into().expect("one output per matrix"))
}

/// `x: [n, in]` (f32 on the CPU, checked against every matrix of `ws`) as
/// contiguous f32 and its rows quantized on candle's barrier pool.
fn quantized_rows(x: &Tensor, ws: &[&QMatrix]) -> Result<(usize, Tensor, QActivations)> {
    use candle_core::Storage;
    let (n, k) = x.dims2()?;
    if let Some(w) = ws.iter().find(|w| k != w.cols() || !x.device().is_cpu()) {
        return Err(ModelError::InvalidArgument(format!(
            "a [{n}, {k}] input on {:?} for a [{}, {}] matrix held on the CPU",
            x.device(),
            w.rows(),
            w.cols()
        )));
    }
    let x = x.to_dtype(DType::F32)?.contiguous()?;
    let acts = {
        let (storage, layout) = x.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else {
            unreachable!("the device was checked to be the CPU");
        };
        let values = &cpu.as_slice::<f32>()?[layout.start_offset()..][..n * k];
        QActivations::quantize_on(n, k, values, &CandlePool)
            .map_err(|e| ModelError::InvalidArgument(e.to_string()))?
    };
    Ok((n, x, acts))
}

/// `x: [n, in]` (f32 on the CPU) times a packed `w` (`[out, in]`): `x`'s rows
/// quantized one by one, then [`QMatrix::matmul_on`] candle's barrier pool.
fn packed_forward(w: &QMatrix, x: &Tensor) -> Result<Tensor> {
    let (n, x, acts) = quantized_rows(x, &[w])?;
    let mut out = vec![0f32; n * w.rows()];
    w.matmul_on(&acts, default_isa(), &mut out, &CandlePool)
        .map_err(|e| ModelError::InvalidArgument(e.to_string()))?;
    Ok(Tensor::from_vec(out, (n, w.rows()), x.device())?)
}

/// candle's barrier pool, the one the attention and element-wise kernels run
/// on: the products share its threads instead of waking rayon's beside it
/// (on 2 cores the two pools' threads took turns: a third of a decode step
/// went to the scheduler, perf).
struct CandlePool;

impl Spread for CandlePool {
    fn threads(&self) -> usize {
        candle_core::utils::barrier_pool().n_workers() + 1
    }

    fn spread(&self, items: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        candle_core::utils::barrier_pool().execute_chunked(items, f);
    }
}

/// A GGUF tensor in [`crate::quant`]'s blocks: converted from its own type
/// where the quant module reads it, else dequantized and quantized again.
fn packed_from_qtensor(q: &QTensor, target: Target) -> Result<QMatrix> {
    let &[rows, cols] = q.shape().dims() else {
        return Err(ModelError::Format(format!("a matrix of shape {:?}", q.shape())));
    };
    let ty = match q.dtype() {
        GgmlDType::F32 => Some(GgmlType::F32),
        GgmlDType::F16 => Some(GgmlType::F16),
        GgmlDType::BF16 => Some(GgmlType::BF16),
        GgmlDType::Q4_0 => Some(GgmlType::Q4_0),
        GgmlDType::Q4_1 => Some(GgmlType::Q4_1),
        GgmlDType::Q5_0 => Some(GgmlType::Q5_0),
        GgmlDType::Q8_0 => Some(GgmlType::Q8_0),
        GgmlDType::Q4K => Some(GgmlType::Q4_K),
        GgmlDType::Q6K => Some(GgmlType::Q6_K),
        _ => None,
    };
    match ty {
        Some(ty) => QMatrix::from_ggml(ty, &q.data()?, rows, cols, target).map_err(format_error),
        None => {
            let format = match target {
                Target::Q4 => Format::Q4,
                Target::Q8 | Target::AsStored => Format::Q8,
            };
            let values = q.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
            QMatrix::quantize(format, rows, cols, &values).map_err(format_error)
        }
    }
}

/// A conversion the quant module refused, as a model-file error.
fn format_error(e: crate::quant::QuantError) -> ModelError {
    ModelError::Format(format!("weights not convertible to blocks: {e}"))
}

/// How a random test weight is drawn: each value `offset + scale * u`, `u`
/// uniform in `[-1, 1)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Draw {
    /// The spread around `offset`.
    pub(crate) scale: f32,
    /// The centre.
    pub(crate) offset: f32,
}

impl Draw {
    /// Norm weights: near 1 (`1 ± 0.2`).
    pub(crate) const NORM: Draw = Draw::new(0.2, 1.0);

    /// `offset + scale * u`.
    pub(crate) const fn new(scale: f32, offset: f32) -> Self {
        Draw { scale, offset }
    }

    /// A matrix `[out, in]` with `fan_in = in`: variance `1 / fan_in`, so
    /// products keep their size.
    pub(crate) fn matrix(fan_in: usize) -> Self {
        Draw::new((3.0 / fan_in as f32).sqrt(), 0.0)
    }

    /// The same draw spread `factor` times wider.
    pub(crate) fn times(self, factor: f32) -> Self {
        Draw::new(factor * self.scale, self.offset)
    }

    /// `n` values drawn from `rng`.
    pub(crate) fn values(self, rng: &mut SplitMix64, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| self.offset + self.scale * rng.next_sym())
            .collect()
    }
}

/// One weight a model asks for: its GGUF name, its shape (`[out, in]` for a
/// matrix, outermost first) and how a random test model draws it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct WeightSpec {
    /// The GGUF name (`token_embd.weight`, `blk.3.attn_q.weight`, ...).
    pub(crate) name: String,
    /// The dimensions, outermost first.
    pub(crate) shape: Vec<usize>,
    /// How a random model draws it.
    pub(crate) draw: Draw,
}

impl WeightSpec {
    /// The weight called `name`.
    pub(crate) fn new(name: &str, shape: Vec<usize>, draw: Draw) -> Self {
        WeightSpec {
            name: name.to_string(),
            shape,
            draw,
        }
    }

    /// Block `layer`'s weight `name` (`blk.{layer}.{name}.weight`).
    pub(crate) fn block(layer: usize, name: &str, shape: Vec<usize>, draw: Draw) -> Self {
        WeightSpec::new(&format!("blk.{layer}.{name}.weight"), shape, draw)
    }

    /// The weights every decoder has around its blocks ([`Trunk::new`] reads
    /// them): the token embedding `[vocab, dim]` (drawn by `embed`), the final
    /// norm `[dim]`.
    pub(crate) fn trunk(vocab: usize, dim: usize, embed: Draw) -> [Self; 2] {
        [
            WeightSpec::new("token_embd.weight", vec![vocab, dim], embed),
            WeightSpec::new("output_norm.weight", vec![dim], Draw::NORM),
        ]
    }

    /// How many values it holds.
    pub(crate) fn len(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Where a candle model's weights come from while it is built, asked for one
/// by one in a fixed order (the order random weights are drawn in).
pub(crate) trait WeightSource {
    /// The matrix `w` (`[out, in]`).
    fn linear(&mut self, w: &WeightSpec) -> Result<Linear>;
    /// The weight `w` in f32 (norm weights).
    fn tensor(&mut self, w: &WeightSpec) -> Result<Tensor>;
    /// The embedding `w` in f32, and as the file stores it (none for random
    /// weights), for an output projection tied to it.
    fn embedding(&mut self, w: &WeightSpec) -> Result<(Tensor, Option<QTensor>)>;
}

/// A GGUF file's weights: matrices held as `mode` says (dense ones multiplied
/// by `kernel`), everything else dequantized to f32.
pub(crate) struct GgufWeights<'a, R> {
    tensors: Tensors<'a, R>,
    mode: WeightMode,
    kernel: DenseKernel,
    device: &'a Device,
}

impl<'a, R: std::io::Read + std::io::Seek> GgufWeights<'a, R> {
    /// The weights of `tensors`, on `device`.
    pub(crate) fn new(
        tensors: Tensors<'a, R>,
        mode: WeightMode,
        kernel: DenseKernel,
        device: &'a Device,
    ) -> Self {
        GgufWeights {
            tensors,
            mode,
            kernel,
            device,
        }
    }

    /// Whether the file holds a weight called `name`.
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.tensors.contains(name)
    }
}

impl<R: std::io::Read + std::io::Seek> WeightSource for GgufWeights<'_, R> {
    fn linear(&mut self, w: &WeightSpec) -> Result<Linear> {
        Linear::new(
            self.tensors.read(&w.name, &w.shape)?,
            self.mode,
            self.kernel,
            self.device,
        )
    }

    fn tensor(&mut self, w: &WeightSpec) -> Result<Tensor> {
        Ok(self.tensors.read(&w.name, &w.shape)?.dequantize(self.device)?)
    }

    fn embedding(&mut self, w: &WeightSpec) -> Result<(Tensor, Option<QTensor>)> {
        let stored = self.tensors.read(&w.name, &w.shape)?;
        Ok((stored.dequantize(self.device)?, Some(stored)))
    }
}

/// Deterministic pseudo-random f32 weights for tests, each drawn as its
/// spec says, in the order asked for, from one seeded generator.
pub(crate) struct RandomWeights<'a> {
    rng: SplitMix64,
    mode: WeightMode,
    kernel: DenseKernel,
    device: &'a Device,
}

impl<'a> RandomWeights<'a> {
    /// Weights from `seed` on `device`; matrices held as `mode` says (drawn
    /// in f32, then converted), dense ones multiplied by `kernel`.
    pub(crate) fn new(seed: u64, mode: WeightMode, kernel: DenseKernel, device: &'a Device) -> Self {
        RandomWeights {
            rng: SplitMix64(seed),
            mode,
            kernel,
            device,
        }
    }
}

impl WeightSource for RandomWeights<'_> {
    fn linear(&mut self, w: &WeightSpec) -> Result<Linear> {
        Linear::from_f32(self.tensor(w)?, self.mode, self.kernel)
    }

    fn tensor(&mut self, w: &WeightSpec) -> Result<Tensor> {
        let values = w.draw.values(&mut self.rng, w.len());
        Ok(Tensor::from_vec(values, w.shape.as_slice(), self.device)?)
    }

    fn embedding(&mut self, w: &WeightSpec) -> Result<(Tensor, Option<QTensor>)> {
        Ok((self.tensor(w)?, None))
    }
}

/// A small deterministic generator for test weights.
pub(crate) struct SplitMix64(pub(crate) u64);

impl SplitMix64 {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    pub(crate) fn next_sym(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}
