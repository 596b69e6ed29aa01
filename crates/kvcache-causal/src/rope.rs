//! A ready-made key shift for rotary position embeddings (RoPE).
//!
//! When a removal moves positions down by `d`, keys already rotated for position
//! `p` must be rotated for `p - d`. Rotations compose, so the shift rotates each
//! key by the delta alone: for pair `i` of the rotated dimensions, angle
//! `delta * freq_scale * base^(-2i / dims)`.

use candle_core::{DType, Tensor};
use kvcache_api::{CacheError, KeyShift, Pos, Result};

/// How the rotated dimensions are paired.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RopeLayout {
    /// Adjacent pairs `(x[2i], x[2i + 1])`: llama.cpp's normal mode, GGUF llama.
    Normal,
    /// Halves `(x[i], x[i + dims / 2])`: GPT-NeoX, and Hugging Face's
    /// `rotate_half` models.
    NeoX,
}

/// Re-rotates keys by position deltas; implements [`KeyShift`] for
/// [`crate::CausalKvCache`].
///
/// ```
/// use candle_core::{Device, Tensor};
/// use kvcache_api::KeyShift;
/// use kvcache_causal::{RopeLayout, RopeShift};
///
/// let rope = RopeShift::new(RopeLayout::NeoX, 4, 10000.0)?;
/// // One key [cells = 1, kv_heads = 1, head_dim = 4] moved back by 1 position.
/// let key = Tensor::new(&[[[1f32, 0., 0., 0.]]], &Device::Cpu).unwrap();
/// let shifted = rope.shift(0, &key, &[-1])?;
/// let v = shifted.flatten_all().unwrap().to_vec1::<f32>().unwrap();
/// assert!((v[0] - 1f32.cos()).abs() < 1e-6 && (v[2] + 1f32.sin()).abs() < 1e-6);
/// # Ok::<(), kvcache_api::CacheError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct RopeShift {
    layout: RopeLayout,
    dims: usize,
    base: f64,
    freq_scale: f64,
}

impl RopeShift {
    /// A shift rotating the first `dims` dimensions of each head (`dims` even,
    /// at most the head size) with frequency base `base`.
    pub fn new(layout: RopeLayout, dims: usize, base: f32) -> Result<Self> {
        if dims == 0 || !dims.is_multiple_of(2) {
            return Err(CacheError::InvalidArgument(format!(
                "rope dims must be even and positive, got {dims}"
            )));
        }
        if !(base.is_finite() && base > 0.0) {
            return Err(CacheError::InvalidArgument(format!(
                "rope frequency base must be positive, got {base}"
            )));
        }
        Ok(RopeShift {
            layout,
            dims,
            base: f64::from(base),
            freq_scale: 1.0,
        })
    }

    /// Sets linear position scaling (`freq_scale = 1 / factor`).
    pub fn with_freq_scale(mut self, freq_scale: f32) -> Self {
        self.freq_scale = f64::from(freq_scale);
        self
    }

    /// Rotates `keys` `[n, kv_heads, head_dim]` by `shifts[i]` positions for row
    /// `i`; returns a new tensor of the same shape and dtype.
    pub fn rotate(&self, keys: &Tensor, shifts: &[Pos]) -> Result<Tensor> {
        let (n, _, head_dim) = keys.dims3().map_err(|_| CacheError::ShapeMismatch {
            what: "keys to shift",
            expected: vec![shifts.len(), 0, self.dims],
            got: keys.dims().to_vec(),
        })?;
        if shifts.len() != n {
            return Err(CacheError::ShapeMismatch {
                what: "shifts",
                expected: vec![n],
                got: vec![shifts.len()],
            });
        }
        if self.dims > head_dim {
            return Err(CacheError::InvalidArgument(format!(
                "rope dims {} exceed the head size {head_dim}",
                self.dims
            )));
        }
        self.rotate_impl(keys, shifts).map_err(CacheError::backend)
    }

    fn rotate_impl(&self, keys: &Tensor, shifts: &[Pos]) -> candle_core::Result<Tensor> {
        let (n, heads, head_dim) = keys.dims3()?;
        let half = self.dims / 2;
        let mut cos = Vec::with_capacity(n * half);
        let mut sin = Vec::with_capacity(n * half);
        for &shift in shifts {
            for i in 0..half {
                let freq = self.base.powf(-2.0 * i as f64 / self.dims as f64);
                let theta = f64::from(shift) * self.freq_scale * freq;
                cos.push(theta.cos() as f32);
                sin.push(theta.sin() as f32);
            }
        }
        let device = keys.device();
        let cos = Tensor::from_vec(cos, (n, 1, half), device)?;
        let sin = Tensor::from_vec(sin, (n, 1, half), device)?;
        let x = keys.to_dtype(DType::F32)?;
        let rot = x.narrow(2, 0, self.dims)?;
        let (x0, x1) = match self.layout {
            RopeLayout::Normal => {
                let pairs = rot.reshape((n, heads, half, 2))?;
                (
                    pairs.narrow(3, 0, 1)?.squeeze(3)?,
                    pairs.narrow(3, 1, 1)?.squeeze(3)?,
                )
            }
            RopeLayout::NeoX => (rot.narrow(2, 0, half)?, rot.narrow(2, half, half)?),
        };
        let y0 = (x0.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
        let y1 = (x0.broadcast_mul(&sin)? + x1.broadcast_mul(&cos)?)?;
        let rotated = match self.layout {
            RopeLayout::Normal => Tensor::stack(&[y0, y1], 3)?.reshape((n, heads, self.dims))?,
            RopeLayout::NeoX => Tensor::cat(&[y0, y1], 2)?,
        };
        let out = if self.dims < head_dim {
            Tensor::cat(&[rotated, x.narrow(2, self.dims, head_dim - self.dims)?], 2)?
        } else {
            rotated
        };
        out.to_dtype(keys.dtype())
    }
}

impl KeyShift<Tensor> for RopeShift {
    fn shift(&self, _layer: usize, keys: &Tensor, shifts: &[Pos]) -> Result<Tensor> {
        self.rotate(keys, shifts)
    }
}
