//! GGUF tensor encodings: the ggml type tags this crate understands, their
//! block geometry, and a reference dequantization of raw little-endian bytes.
//!
//! The dequantization here follows the ggml formulas operation by operation
//! (same f32 products and sums in the same order), so that it can serve as the
//! reference that exact conversions must reproduce bit for bit.

use super::QuantError;
use half::{bf16, f16};

/// Element types of GGUF tensors that can be converted into a [`super::QMatrix`].
/// Variant names follow ggml's spelling.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit IEEE floats.
    F32,
    /// 16-bit IEEE floats.
    F16,
    /// bfloat16.
    BF16,
    /// 32-value blocks: f16 `d`, 16 nibble bytes; value = d * (q - 8).
    Q4_0,
    /// 32-value blocks: f16 `d`, f16 `m`, 16 nibble bytes; value = d * q + m.
    Q4_1,
    /// 32-value blocks: f16 `d`, 32 high bits, 16 nibble bytes; value = d * (q - 16).
    Q5_0,
    /// 32-value blocks: f16 `d`, 32 `i8`; value = d * q.
    Q8_0,
    /// 256-value super-blocks of eight 32-value sub-blocks with 6-bit scales and mins.
    Q4_K,
    /// 256-value super-blocks of sixteen 16-value sub-blocks with 8-bit scales, 6-bit quants.
    Q6_K,
}

impl GgmlType {
    /// Number of values encoded by one block of this type (1 for float types).
    pub fn block_values(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q8_0 => 32,
            GgmlType::Q4_K | GgmlType::Q6_K => 256,
        }
    }

    /// Number of bytes of one block of this type.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q8_0 => 34,
            GgmlType::Q4_K => 144,
            GgmlType::Q6_K => 210,
        }
    }

    /// Number of bytes of a `[rows, cols]` tensor of this type, or an error if
    /// `cols` is not a whole number of blocks.
    pub fn tensor_bytes(self, rows: usize, cols: usize) -> Result<usize, QuantError> {
        let bv = self.block_values();
        if !cols.is_multiple_of(bv) {
            return Err(QuantError::BadShape {
                rows,
                cols,
                block: bv,
            });
        }
        Ok(rows * (cols / bv) * self.block_bytes())
    }
}

/// Reads the little-endian f16 at `bytes[at..at + 2]` as f32.
pub(crate) fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// Raw bits of the little-endian f16 at `bytes[at..at + 2]`.
pub(crate) fn f16_bits_at(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([bytes[at], bytes[at + 1]])
}

/// The 6-bit scale and min of sub-block `j` (0..8) from a Q4_K `scales[12]` array.
pub(crate) fn q4k_scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Dequantizes a raw `[rows, cols]` GGUF tensor of type `ty` to row-major f32.
///
/// This is the reference decoding: exact conversions into a
/// [`super::QMatrix`] dequantize bit-identically to it.
pub fn dequantize_ggml(ty: GgmlType, bytes: &[u8], rows: usize, cols: usize) -> Result<Vec<f32>, QuantError> {
    let expected = ty.tensor_bytes(rows, cols)?;
    if bytes.len() != expected {
        return Err(QuantError::BadLength {
            expected,
            got: bytes.len(),
        });
    }
    let mut out = vec![0f32; rows * cols];
    let bb = ty.block_bytes();
    let bv = ty.block_values();
    for (block, dst) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(bv)) {
        dequantize_block(ty, block, dst);
    }
    Ok(out)
}

/// Dequantizes one block of type `ty` into `dst` (`ty.block_values()` values).
fn dequantize_block(ty: GgmlType, b: &[u8], dst: &mut [f32]) {
    match ty {
        GgmlType::F32 => dst[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => dst[0] = f16_at(b, 0),
        GgmlType::BF16 => dst[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        GgmlType::Q4_0 => {
            let d = f16_at(b, 0);
            for i in 0..16 {
                dst[i] = ((b[2 + i] & 0x0f) as i32 - 8) as f32 * d;
                dst[i + 16] = ((b[2 + i] >> 4) as i32 - 8) as f32 * d;
            }
        }
        GgmlType::Q4_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            for i in 0..16 {
                dst[i] = (b[4 + i] & 0x0f) as f32 * d + m;
                dst[i + 16] = (b[4 + i] >> 4) as f32 * d + m;
            }
        }
        GgmlType::Q5_0 => {
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for i in 0..16 {
                let lo = (b[6 + i] & 0x0f) | ((((qh >> i) & 1) as u8) << 4);
                let hi = (b[6 + i] >> 4) | ((((qh >> (i + 16)) & 1) as u8) << 4);
                dst[i] = (lo as i32 - 16) as f32 * d;
                dst[i + 16] = (hi as i32 - 16) as f32 * d;
            }
        }
        GgmlType::Q8_0 => {
            let d = f16_at(b, 0);
            for i in 0..32 {
                dst[i] = (b[2 + i] as i8) as f32 * d;
            }
        }
        GgmlType::Q4_K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let (scales, qs) = (&b[4..16], &b[16..144]);
            for chunk in 0..4 {
                let q = &qs[32 * chunk..32 * chunk + 32];
                let (sc1, m1) = q4k_scale_min(2 * chunk, scales);
                let (sc2, m2) = q4k_scale_min(2 * chunk + 1, scales);
                let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
                let (d2, min2) = (d * sc2 as f32, dmin * m2 as f32);
                let y = &mut dst[64 * chunk..64 * chunk + 64];
                for l in 0..32 {
                    y[l] = d1 * (q[l] & 0x0f) as f32 - min1;
                    y[l + 32] = d2 * (q[l] >> 4) as f32 - min2;
                }
            }
        }
        GgmlType::Q6_K => {
            let d = f16_at(b, 208);
            for half_idx in 0..2 {
                let ql = &b[64 * half_idx..64 * half_idx + 64];
                let qh = &b[128 + 32 * half_idx..128 + 32 * half_idx + 32];
                let sc = &b[192 + 8 * half_idx..192 + 8 * half_idx + 8];
                let y = &mut dst[128 * half_idx..128 * half_idx + 128];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    let s = |k: usize| d * (sc[is + k] as i8) as f32;
                    y[l] = s(0) * q1 as f32;
                    y[l + 32] = s(2) * q2 as f32;
                    y[l + 64] = s(4) * q3 as f32;
                    y[l + 96] = s(6) * q4 as f32;
                }
            }
        }
    }
}
