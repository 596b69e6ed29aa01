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

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};

use crate::gguf::Tensors;
use crate::Result;

/// How the weights are held in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightMode {
    /// Every weight dequantized to f32 (the default; fast on CPU, and what the
    /// equivalence tests use).
    #[default]
    F32,
    /// Matrices kept in their GGUF quantization and multiplied with candle's
    /// quantized kernels (smaller, but Q4_1 has no fast CPU kernel).
    Quantized,
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
}

impl Linear {
    /// A GGUF matrix `q`, dequantized to f32 on `device` or kept quantized as
    /// `mode` says; dense products through `kernel`.
    pub(crate) fn new(q: QTensor, mode: WeightMode, kernel: DenseKernel, device: &Device) -> Result<Self> {
        Ok(match mode {
            WeightMode::F32 => Linear::Dense(q.dequantize(device)?, kernel),
            WeightMode::Quantized => Linear::Quant(QMatMul::from_qtensor(q)?),
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
            (WeightMode::Quantized, Some(q)) => Linear::Quant(QMatMul::from_qtensor(q)?),
            _ => Linear::Dense(embed.clone(), kernel),
        })
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
        })
    }
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
    kernel: DenseKernel,
    device: &'a Device,
}

impl<'a> RandomWeights<'a> {
    /// Weights from `seed` on `device`; matrices multiplied by `kernel`.
    pub(crate) fn new(seed: u64, kernel: DenseKernel, device: &'a Device) -> Self {
        RandomWeights {
            rng: SplitMix64(seed),
            kernel,
            device,
        }
    }
}

impl WeightSource for RandomWeights<'_> {
    fn linear(&mut self, w: &WeightSpec) -> Result<Linear> {
        Ok(Linear::Dense(self.tensor(w)?, self.kernel))
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
