//! [`Plane`]: the tensors holding one layer's keys or its values, stored as a
//! float type or as `q8_0` blocks.
//!
//! A plane has a *logical* shape, the shape of the float tensor it stands for
//! (`[cells, kv_heads, head_dim]`, or `[kv_heads, head_dim_v, cells]` for
//! permuted values). A float plane is that tensor. A `q8_0` plane is two tensors
//! sharing the cell axis: the integers, in the logical shape, and the scales, in
//! the logical shape with the head dimension divided by 32. Every cell-axis
//! operation (narrow, gather, write) applies to each part alike, so moving cells
//! never decodes them.

use candle_core::{DType as CandleDType, Device, Result, Tensor};
use kvcache_api::{KvStorage, StoredKv};

use super::q8_0;
use super::same_storage;

/// One layer's keys or values as stored.
#[derive(Debug, Clone)]
pub(crate) enum Plane {
    /// Stored in a float type, in the logical shape.
    Float(Tensor),
    /// `q8_0` blocks along axis `axis` (the head dimension).
    Q8_0 {
        /// `u8` holding `q + 128`, the logical shape.
        quants: Tensor,
        /// `f16`, the logical shape with `axis` divided by 32.
        scales: Tensor,
        /// The head-dimension axis of the logical shape.
        axis: usize,
    },
}

impl Plane {
    /// A plane of `kind` whose values are all zero, logical shape `shape`, quantized
    /// (if it is) along `axis` (`shape[axis]` then a multiple of 32).
    pub(crate) fn zeros(shape: &[usize], axis: usize, kind: KvStorage, device: &Device) -> Result<Self> {
        match kind.float() {
            Some(dtype) => Ok(Plane::Float(Tensor::zeros(
                shape,
                super::candle_dtype(dtype),
                device,
            )?)),
            None => {
                let mut scale_shape = shape.to_vec();
                scale_shape[axis] /= q8_0::BLOCK;
                Ok(Plane::Q8_0 {
                    // Byte 128 is the integer 0.
                    quants: Tensor::full(128u8, shape, device)?,
                    scales: Tensor::zeros(scale_shape, CandleDType::F16, device)?,
                    axis,
                })
            }
        }
    }

    /// Encodes `x` (any float dtype, the logical shape) as `kind`, blocks along
    /// `axis`: contiguous parts ready for [`Plane::slice_set`].
    pub(crate) fn encode(x: &Tensor, axis: usize, kind: KvStorage) -> Result<Self> {
        match kind.float() {
            Some(dtype) => Ok(Plane::Float(
                x.to_dtype(super::candle_dtype(dtype))?.contiguous()?,
            )),
            None => {
                let (quants, scales) = q8_0::quantize(x, axis)?;
                Ok(Plane::Q8_0 { quants, scales, axis })
            }
        }
    }

    /// The values as a tensor of `dtype`, the logical shape: the stored tensor
    /// itself (a view) when it already is `dtype`, else a new tensor.
    pub(crate) fn decode(&self, dtype: CandleDType) -> Result<Tensor> {
        match self {
            Plane::Float(t) => t.to_dtype(dtype),
            Plane::Q8_0 { quants, scales, axis } => q8_0::dequantize(quants, scales, *axis, dtype),
        }
    }

    /// The plane as the API hands it out: the tensors themselves (no copy).
    pub(crate) fn stored(&self) -> StoredKv<Tensor> {
        match self {
            Plane::Float(t) => StoredKv::Float(t.clone()),
            Plane::Q8_0 { quants, scales, .. } => StoredKv::Q8_0 {
                quants: quants.clone(),
                scales: scales.clone(),
            },
        }
    }

    /// The logical shape.
    pub(crate) fn dims(&self) -> &[usize] {
        match self {
            Plane::Float(t) => t.dims(),
            Plane::Q8_0 { quants, .. } => quants.dims(),
        }
    }

    /// The tensors that make up the plane.
    pub(crate) fn parts(&self) -> impl Iterator<Item = &Tensor> {
        let (first, second) = match self {
            Plane::Float(t) => (t, None),
            Plane::Q8_0 { quants, scales, .. } => (quants, Some(scales)),
        };
        std::iter::once(first).chain(second)
    }

    /// Applies `f` to every part (an operation along an axis other than the
    /// head dimension, such as the cell axis), keeping the blocks' axis.
    pub(crate) fn map(&self, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok(match self {
            Plane::Float(t) => Plane::Float(f(t)?),
            Plane::Q8_0 { quants, scales, axis } => Plane::Q8_0 {
                quants: f(quants)?,
                scales: f(scales)?,
                axis: *axis,
            },
        })
    }

    /// `[n, heads, dim]` (blocks along axis 2) as `[heads, dim, n]` (blocks along
    /// axis 1), contiguous: how permuted values are stored.
    pub(crate) fn cells_last(&self) -> Result<Self> {
        let permute = |t: &Tensor| t.permute((1, 2, 0))?.contiguous();
        Ok(match self.map(permute)? {
            Plane::Q8_0 { quants, scales, .. } => Plane::Q8_0 {
                quants,
                scales,
                axis: 1,
            },
            float => float,
        })
    }

    /// Writes `src` (the same kind, contiguous) into this plane at `offset` along
    /// `dim`, part by part.
    pub(crate) fn slice_set(&self, src: &Plane, dim: usize, offset: usize) -> Result<()> {
        for (dst, src) in self.parts().zip(src.parts()) {
            dst.slice_set(src, dim, offset)?;
        }
        Ok(())
    }

    /// Whether `t` is a view of one of this plane's tensors.
    pub(crate) fn aliases(&self, t: &Tensor) -> bool {
        self.parts().any(|p| same_storage(p, t))
    }

    /// Panics unless the parts agree: float of `kind`, or `u8` integers and
    /// `f16` scales whose shape is the integers' with the block axis divided by 32.
    pub(crate) fn check(&self, kind: KvStorage, what: &str) {
        match (self, kind.float()) {
            (Plane::Float(t), Some(dtype)) => {
                assert_eq!(t.dtype(), super::candle_dtype(dtype), "{what}: stored dtype")
            }
            (Plane::Q8_0 { quants, scales, axis }, None) => {
                assert_eq!(
                    (quants.dtype(), scales.dtype()),
                    (CandleDType::U8, CandleDType::F16),
                    "{what}"
                );
                let mut expected = quants.dims().to_vec();
                assert!(
                    expected[*axis].is_multiple_of(q8_0::BLOCK),
                    "{what}: {expected:?} off the blocks"
                );
                expected[*axis] /= q8_0::BLOCK;
                assert_eq!(
                    scales.dims(),
                    expected.as_slice(),
                    "{what}: scales for {:?}",
                    quants.dims()
                );
            }
            _ => panic!("{what}: stored as {self:?}, configured as {kind}"),
        }
    }

    /// Bytes allocated.
    pub(crate) fn bytes(&self) -> usize {
        self.parts()
            .map(|p| p.elem_count() * p.dtype().size_in_bytes())
            .sum()
    }
}
