//! ggml's `q8_0` on candle tensors: blocks of [`BLOCK`] consecutive values along
//! one axis, each stored as signed 8-bit integers `q` and one f16 scale `d`, read
//! back as `q * d`.
//!
//! The arithmetic is ggml's `quantize_row_q8_0_ref`: `d = max|x| / 127`,
//! `q = round(x / d)` (half away from zero; `q = 0` when `d = 0`), `d` stored as
//! f16. The integers are kept as `u8` holding `q + 128` (candle has no `i8`), the
//! same 32 bytes per block; the scales are a tensor of their own beside them, so
//! that the cell axis stays a tensor axis for both and cells move with plain
//! `narrow`, `index_select` and `slice_set`.
//!
//! Re-quantizing dequantized blocks gives the same integers and scales back: the
//! largest value of a block is `±127 d`, so the scale comes out as `d` again and
//! each `q * d / d` rounds to `q`. A key shift relies on it for the cells of a
//! chunk that do not move.

use candle_core::{DType, Result, Tensor};

/// Values per block.
pub(crate) const BLOCK: usize = 32;

/// The offset the stored bytes carry: byte `b` holds the integer `b - 128`.
const ZERO: f64 = 128.0;

/// `shape` with axis `axis` (of length `len`, a multiple of [`BLOCK`]) split
/// into `[len / BLOCK, BLOCK]`.
fn blocked(shape: &[usize], axis: usize) -> Vec<usize> {
    let mut out = shape.to_vec();
    out[axis] /= BLOCK;
    out.insert(axis + 1, BLOCK);
    out
}

/// Quantizes `x` (any float dtype; `x.dims()[axis]` a multiple of [`BLOCK`])
/// in blocks along `axis`: returns the integers (`u8`, `x`'s shape) and the
/// scales (`f16`, `x`'s shape with `axis` divided by [`BLOCK`]).
pub(crate) fn quantize(x: &Tensor, axis: usize) -> Result<(Tensor, Tensor)> {
    let shape = x.dims().to_vec();
    let blocks = x
        .to_dtype(DType::F32)?
        .contiguous()?
        .reshape(blocked(&shape, axis))?;
    let amax = blocks.abs()?.max_keepdim(axis + 1)?;
    // Divided, not multiplied by 1/127, to round exactly as ggml does.
    let d = amax.broadcast_div(&Tensor::new(127f32, x.device())?)?;
    let nonzero = d.gt(0f64)?;
    let id = nonzero.where_cond(&d.recip()?, &d.zeros_like()?)?;
    let quants = blocks
        .broadcast_mul(&id)?
        .round()?
        .affine(1.0, ZERO)?
        .to_dtype(DType::U8)?
        .reshape(shape.as_slice())?;
    let scales = d.squeeze(axis + 1)?.to_dtype(DType::F16)?;
    Ok((quants, scales))
}

/// Reads blocks back: `quants` (`u8`) times `scales` (`f16`, `quants`' shape with
/// `axis` divided by [`BLOCK`]), as a new contiguous tensor of `dtype` shaped
/// like `quants`. Views (narrowed along another axis) are fine.
pub(crate) fn dequantize(quants: &Tensor, scales: &Tensor, axis: usize, dtype: DType) -> Result<Tensor> {
    let shape = quants.dims().to_vec();
    let q = quants
        .to_dtype(DType::F32)?
        .affine(1.0, -ZERO)?
        .reshape(blocked(&shape, axis))?;
    let d = scales.to_dtype(DType::F32)?.unsqueeze(axis + 1)?;
    q.broadcast_mul(&d)?.reshape(shape.as_slice())?.to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32 / (1 << 24) as f32
                    - 0.5
            })
            .collect()
    }

    #[test]
    fn blocks_follow_ggml() {
        // One block: max |x| = 2.54 -> d = 0.02, x = 1.0 -> q = 50.
        let mut x = vec![0f32; BLOCK];
        x[0] = -2.54;
        x[1] = 1.0;
        x[2] = 0.011; // 0.55 rounds away from zero to 1
        let t = Tensor::from_vec(x.clone(), (1, BLOCK), &Device::Cpu).unwrap();
        let (q, d) = quantize(&t, 1).unwrap();
        let q: Vec<i32> = q
            .flatten_all()
            .unwrap()
            .to_vec1::<u8>()
            .unwrap()
            .iter()
            .map(|&b| i32::from(b) - 128)
            .collect();
        assert_eq!(&q[..4], &[-127, 50, 1, 0]);
        let d = d
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(d, vec![half::f16::from_f32(2.54 / 127.0).to_f32()]);
        // An all-zero block has scale 0 and reads back as zeros.
        let z = Tensor::zeros((2, BLOCK), DType::F32, &Device::Cpu).unwrap();
        let (q, d) = quantize(&z, 1).unwrap();
        let back = dequantize(&q, &d, 1, DType::F32).unwrap();
        assert_eq!(
            back.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            vec![0f32; 2 * BLOCK]
        );
    }

    #[test]
    fn round_trips_within_half_a_step_and_requantizes_exactly() {
        for axis in [1, 2] {
            let shape = if axis == 2 { (5, 3, 64) } else { (3, 64, 5) };
            let x = Tensor::from_vec(values(5 * 3 * 64, 7), shape, &Device::Cpu).unwrap();
            let (q, d) = quantize(&x, axis).unwrap();
            assert_eq!(q.dims(), x.dims());
            let back = dequantize(&q, &d, axis, DType::F32).unwrap();
            // |x - q d| <= d / 2 (+ the f16 rounding of d, at most 127 * d * 2^-11).
            let step = d.to_dtype(DType::F32).unwrap().unsqueeze(axis + 1).unwrap();
            let bound = (step * (0.5 + 127.0 / 2048.0)).unwrap();
            let err = (x.reshape(blocked(x.dims(), axis)).unwrap()
                - back.reshape(blocked(x.dims(), axis)).unwrap())
            .unwrap()
            .abs()
            .unwrap();
            let over = err
                .broadcast_gt(&bound)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .sum_all()
                .unwrap();
            assert_eq!(over.to_scalar::<f32>().unwrap(), 0.0, "axis {axis}");
            let (q2, d2) = quantize(&back, axis).unwrap();
            let bytes = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<u8>().unwrap();
            assert_eq!(bytes(&q2), bytes(&q));
            let halves = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<half::f16>().unwrap();
            assert_eq!(halves(&d2), halves(&d));
        }
    }
}
