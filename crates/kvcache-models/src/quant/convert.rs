//! Building a [`QMatrix`]: quantizing f32 values, converting raw GGUF tensors,
//! and the way back (dequantization, ggml bytes).
//!
//! Exact conversions (Q8_0, Q5_0, Q4_0 into Q8; Q4_0, Q4_1 into Q4) keep every
//! value bit for bit. Q4_K into Q4 folds each sub-block's 6-bit scale and min
//! into the f16 `d` and `m` of one Q4 block: `d = f16(super_d * sc)` and
//! `m = f16(-super_dmin * min)`, a rounding of relative size 2^-11 at most
//! (for scales in f16's normal range). Everything else is requantized from
//! its dequantized f32 values.

use super::ggml::{dequantize_ggml, f16_at, f16_bits_at, q4k_scale_min, GgmlType};
use super::{Format, QMatrix, QuantError, RowMajor, BLOCK};
use half::f16;

/// Which weight format a GGUF tensor is converted into.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// Q4_0, Q4_1 and Q4_K become [`Format::Q4`]; every other type becomes
    /// [`Format::Q8`] (exactly for Q8_0 and Q5_0, requantized otherwise).
    AsStored,
    /// Always [`Format::Q8`] (exact for Q8_0, Q5_0 and Q4_0).
    Q8,
    /// Always [`Format::Q4`] (exact for Q4_0 and Q4_1, rounded scales for Q4_K).
    Q4,
}

/// f16 of `x`, or an error if it overflows.
fn to_f16_bits(x: f32) -> Result<u16, QuantError> {
    let h = f16::from_f32(x);
    if h.is_infinite() || h.is_nan() {
        return Err(QuantError::ScaleOverflow);
    }
    Ok(h.to_bits())
}

/// Quantizes 32 values to a Q8 block: `d = absmax / 127` rounded to f16, quants
/// rounded to nearest against that rounded scale.
fn quantize_q8_block(x: &[f32], quants: &mut [u8]) -> Result<u16, QuantError> {
    let absmax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = to_f16_bits(absmax / 127.0)?;
    let dd = f16::from_bits(d).to_f32();
    let id = if dd == 0.0 { 0.0 } else { 1.0 / dd };
    for (q, v) in quants.iter_mut().zip(x) {
        *q = (v * id).round().clamp(-127.0, 127.0) as i8 as u8;
    }
    Ok(d)
}

/// Quantizes 32 values to a Q4 block: `d = (max - min) / 15`, `m = min`, both
/// rounded to f16, quants rounded to nearest against the rounded values.
fn quantize_q4_block(x: &[f32], nibbles: &mut [u8]) -> Result<(u16, u16), QuantError> {
    let min = x.iter().fold(f32::INFINITY, |a, &v| a.min(v));
    let max = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    let d = to_f16_bits((max - min) / 15.0)?;
    let m = to_f16_bits(min)?;
    let (dd, mm) = (f16::from_bits(d).to_f32(), f16::from_bits(m).to_f32());
    let id = if dd == 0.0 { 0.0 } else { 1.0 / dd };
    let q = |v: f32| ((v - mm) * id).round().clamp(0.0, 15.0) as u8;
    for i in 0..16 {
        nibbles[i] = q(x[i]) | (q(x[i + 16]) << 4);
    }
    Ok((d, m))
}

impl QMatrix {
    /// Quantizes a row-major `rows x cols` f32 matrix into `format`.
    pub fn quantize(format: Format, rows: usize, cols: usize, values: &[f32]) -> Result<QMatrix, QuantError> {
        if !cols.is_multiple_of(BLOCK) {
            return Err(QuantError::BadShape {
                rows,
                cols,
                block: BLOCK,
            });
        }
        if values.len() != rows * cols {
            return Err(QuantError::BadLength {
                expected: rows * cols,
                got: values.len(),
            });
        }
        let mut w = RowMajor::with_capacity(format, rows, cols);
        let mut buf = [0u8; 32];
        for x in values.chunks_exact(BLOCK) {
            let qb = &mut buf[..format.quant_bytes()];
            match format {
                Format::Q8 => w.scales.push(quantize_q8_block(x, qb)?),
                Format::Q4 => {
                    let (d, m) = quantize_q4_block(x, qb)?;
                    w.scales.push(d);
                    w.mins.push(m);
                }
            }
            w.quants.extend_from_slice(qb);
        }
        Ok(w.interleave())
    }

    /// Converts a raw little-endian GGUF tensor of type `ty` and shape
    /// `[rows, cols]` (row-major, `cols` values per row) into a matrix.
    pub fn from_ggml(
        ty: GgmlType,
        bytes: &[u8],
        rows: usize,
        cols: usize,
        target: Target,
    ) -> Result<QMatrix, QuantError> {
        if !cols.is_multiple_of(BLOCK) {
            return Err(QuantError::BadShape {
                rows,
                cols,
                block: BLOCK,
            });
        }
        let expected = ty.tensor_bytes(rows, cols)?;
        if bytes.len() != expected {
            return Err(QuantError::BadLength {
                expected,
                got: bytes.len(),
            });
        }
        let format = match (target, ty) {
            (Target::Q8, _) => Format::Q8,
            (Target::Q4, _) => Format::Q4,
            (Target::AsStored, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q4_K) => Format::Q4,
            (Target::AsStored, _) => Format::Q8,
        };
        let mut w = RowMajor::with_capacity(format, rows, cols);
        let blocks = bytes.chunks_exact(ty.block_bytes());
        match (format, ty) {
            (Format::Q8, GgmlType::Q8_0) => blocks.for_each(|b| {
                w.scales.push(f16_bits_at(b, 0));
                w.quants.extend_from_slice(&b[2..34]);
            }),
            (Format::Q8, GgmlType::Q5_0) => blocks.for_each(|b| {
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                let q5 = |i: usize| {
                    let nib = if i < 16 {
                        b[6 + i] & 0x0f
                    } else {
                        b[6 + i - 16] >> 4
                    };
                    (nib | ((((qh >> i) & 1) as u8) << 4)) as i8 - 16
                };
                w.scales.push(f16_bits_at(b, 0));
                w.quants.extend((0..32).map(|i| q5(i) as u8));
            }),
            (Format::Q8, GgmlType::Q4_0) => blocks.for_each(|b| {
                w.scales.push(f16_bits_at(b, 0));
                w.quants
                    .extend(b[2..18].iter().map(|&q| ((q & 0x0f) as i8 - 8) as u8));
                w.quants
                    .extend(b[2..18].iter().map(|&q| ((q >> 4) as i8 - 8) as u8));
            }),
            (Format::Q4, GgmlType::Q4_1) => blocks.for_each(|b| {
                w.scales.push(f16_bits_at(b, 0));
                w.mins.push(f16_bits_at(b, 2));
                w.quants.extend_from_slice(&b[4..20]);
            }),
            (Format::Q4, GgmlType::Q4_0) => {
                for b in blocks {
                    w.scales.push(f16_bits_at(b, 0));
                    w.mins.push(to_f16_bits(-8.0 * f16_at(b, 0))?);
                    w.quants.extend_from_slice(&b[2..18]);
                }
            }
            (Format::Q4, GgmlType::Q4_K) => {
                for b in blocks {
                    push_q4k_super_block(&mut w, b)?;
                }
            }
            _ => {
                let values = dequantize_ggml(ty, bytes, rows, cols)?;
                return QMatrix::quantize(format, rows, cols, &values);
            }
        }
        Ok(w.interleave())
    }

    /// Dequantizes to a row-major `rows x cols` f32 matrix (`d * q` or `d * q + m`).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for j in 0..self.rows {
            for b in 0..self.blocks_per_row() {
                let (d, m, q) = self.block(j, b);
                let d = f16::from_bits(d).to_f32();
                match self.format {
                    Format::Q8 => out.extend(q.iter().map(|&v| d * (v as i8) as f32)),
                    Format::Q4 => {
                        let m = f16::from_bits(m).to_f32();
                        out.extend(q[..16].iter().map(|&v| d * (v & 0x0f) as f32 + m));
                        out.extend(q[..16].iter().map(|&v| d * (v >> 4) as f32 + m));
                    }
                }
            }
        }
        out
    }

    /// The matrix as a raw ggml tensor: `Q8_0` bytes for Q8, `Q4_1` bytes for Q4.
    pub fn to_ggml_bytes(&self) -> (GgmlType, Vec<u8>) {
        let ty = match self.format {
            Format::Q8 => GgmlType::Q8_0,
            Format::Q4 => GgmlType::Q4_1,
        };
        let mut out = Vec::with_capacity(self.rows * self.blocks_per_row() * self.format.block_bytes());
        let qb = self.format.quant_bytes();
        for j in 0..self.rows {
            for b in 0..self.blocks_per_row() {
                let (d, m, q) = self.block(j, b);
                out.extend_from_slice(&d.to_le_bytes());
                if self.format == Format::Q4 {
                    out.extend_from_slice(&m.to_le_bytes());
                }
                out.extend_from_slice(&q[..qb]);
            }
        }
        (ty, out)
    }
}

/// Appends the eight Q4 blocks of one Q4_K super-block to `w`.
fn push_q4k_super_block(w: &mut RowMajor, b: &[u8]) -> Result<(), QuantError> {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for j in 0..8 {
        let (sc, mn) = q4k_scale_min(j, scales);
        w.scales.push(to_f16_bits(d * sc as f32)?);
        w.mins.push(to_f16_bits(-(dmin * mn as f32))?);
        // Sub-block j holds the low (even j) or high (odd j) nibbles of 32 bytes.
        let src = &qs[32 * (j / 2)..32 * (j / 2) + 32];
        let shift = 4 * (j % 2) as u32;
        let nib = |l: usize| (src[l] >> shift) & 0x0f;
        w.quants.extend((0..16).map(|i| nib(i) | (nib(i + 16) << 4)));
    }
    Ok(())
}

/// Converts a raw GGUF tensor into a [`QMatrix`]; same as [`QMatrix::from_ggml`].
pub fn convert(ty: GgmlType, bytes: &[u8], shape: [usize; 2], target: Target) -> Result<QMatrix, QuantError> {
    QMatrix::from_ggml(ty, bytes, shape[0], shape[1], target)
}
