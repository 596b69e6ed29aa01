//! Quantized weights, quantized activations and their product `x @ W^T`.
//!
//! # Formats
//!
//! Weights are kept in 32-value blocks, in one of two formats:
//!
//! * [`Format::Q8`]: per block an f16 scale `d` and 32 `i8` quants, value =
//!   `d * q` (the values of ggml `Q8_0`);
//! * [`Format::Q4`]: per block f16 `d`, f16 `m` and 16 bytes of nibbles
//!   (element `i` in the low nibble of byte `i`, element `i + 16` in the high
//!   nibble), value = `d * q + m` (the values of ggml `Q4_1`).
//!
//! # Layout
//!
//! A [`QMatrix`] interleaves its rows in groups of [`GROUP`] (16), as
//! llama.cpp repacks its CPU weights: for each group and each block, the
//! sixteen rows' scales lie side by side (`scales`, f16 bits; `mins` for Q4),
//! then their quants in 4-byte segments, segment by segment: bytes
//! `4s..4s + 4` of the block of row 0, of row 1, ... of row 15, then segment
//! `s + 1`. One 512-bit load then holds four quants of each of sixteen rows,
//! one `vpdpbusd` against four activations broadcast to every lane adds to
//! sixteen outputs at once, and the float step (scale, convert, add) is paid
//! once a block for all sixteen, not once a block for each. A matrix whose
//! row count is not a multiple of 16 is padded with zero rows, never read
//! back. A Q8 quant is stored offset by 128 (`q ^ 0x80`, an unsigned byte)
//! for `vpdpbusd`'s unsigned operand; a Q4 segment holds the nibbles of
//! elements `4s..4s + 4` (low) and `16 + 4s..` (high). Bytes per value are
//! ggml's (8.5 bits for Q8, 5 bits for Q4) and a block converts back to ggml
//! bytes with [`QMatrix::to_ggml_bytes`].
//!
//! Activations ([`QActivations`]) are quantized per row and per 32-block to
//! `i8` with an f32 scale `d = absmax / 127` and the block sum `s = d * sum(q)`.
//!
//! # Product
//!
//! `y[i][j] = sum_b d_w[j,b] * d_a[i,b] * isum_b + m_w[j,b] * s_a[i,b]`, with
//! the integer block dot product `isum_b` computed exactly. Every kernel
//! accumulates each output block by block in the same fused steps,
//! `acc = fma(d_w * d_a, isum_b, acc)` then, for Q4, `acc = fma(m_w, s_a,
//! acc)`, so every instruction set gives the same bits, and none depends on
//! the batch size, tile position or thread split: a row computed alone equals
//! the same row inside any batch.

mod activations;
#[cfg(target_arch = "aarch64")]
mod arm_neon;
mod convert;
mod ggml;
mod isa;
mod kernel;
mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86_avx2;
#[cfg(target_arch = "x86_64")]
mod x86_avx512;

pub use activations::QActivations;
pub use convert::{convert, Target};
pub use ggml::{dequantize_ggml, GgmlType};
pub use isa::{Isa, ISA_ENV};
pub use kernel::{default_isa, Rayon, Spread};

use std::fmt;

/// Number of values in one quantization block (weights and activations).
pub const BLOCK: usize = 32;

/// Weight rows interleaved together (see the module documentation).
pub const GROUP: usize = 16;

/// Storage format of a [`QMatrix`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    /// 8-bit symmetric blocks (ggml `Q8_0` values).
    Q8,
    /// 4-bit blocks with scale and offset (ggml `Q4_1` values).
    Q4,
}

impl Format {
    /// Bytes of quants per 32-value block.
    pub fn quant_bytes(self) -> usize {
        match self {
            Format::Q8 => 32,
            Format::Q4 => 16,
        }
    }

    /// Bytes per block including scales, as stored (and as in ggml).
    pub fn block_bytes(self) -> usize {
        match self {
            Format::Q8 => 34,
            Format::Q4 => 20,
        }
    }
}

/// Errors of conversions and products.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QuantError {
    /// `cols` is not a multiple of the block size of the source or target.
    BadShape {
        /// Rows requested.
        rows: usize,
        /// Columns requested.
        cols: usize,
        /// Block size that `cols` must be a multiple of.
        block: usize,
    },
    /// The byte or value buffer does not have the size the shape implies.
    BadLength {
        /// Expected length.
        expected: usize,
        /// Length given.
        got: usize,
    },
    /// A scale does not fit f16 (overflow) after conversion.
    ScaleOverflow,
    /// Activations and weights disagree on the inner dimension.
    InnerMismatch {
        /// Columns of the weight matrix.
        weight_cols: usize,
        /// Values per activation row.
        act_cols: usize,
    },
    /// The requested instruction set is not available on this CPU.
    IsaUnavailable(Isa),
}

impl fmt::Display for QuantError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QuantError::BadShape { rows, cols, block } => {
                write!(f, "shape [{rows}, {cols}]: cols not a multiple of {block}")
            }
            QuantError::BadLength { expected, got } => {
                write!(f, "buffer length {got}, expected {expected}")
            }
            QuantError::ScaleOverflow => write!(f, "block scale overflows f16"),
            QuantError::InnerMismatch {
                weight_cols,
                act_cols,
            } => {
                write!(f, "weights have {weight_cols} cols, activations {act_cols}")
            }
            QuantError::IsaUnavailable(isa) => write!(f, "{isa:?} not available on this CPU"),
        }
    }
}

impl std::error::Error for QuantError {}

/// A `rows x cols` weight matrix in 32-value quantized blocks, its rows
/// interleaved in groups of [`GROUP`] (see the module documentation).
#[derive(Clone, Debug, PartialEq)]
pub struct QMatrix {
    rows: usize,
    cols: usize,
    format: Format,
    /// f16 bits of each block's `d`, indexed `[group][block][row in group]`.
    scales: Vec<u16>,
    /// f16 bits of each block's `m`, as `scales` (Q4 only; empty for Q8).
    mins: Vec<u16>,
    /// Quants, `[group][block][segment][row in group][4 bytes]`.
    quants: Vec<u8>,
}

impl QMatrix {
    /// Number of rows (output features).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of columns (input features), a multiple of [`BLOCK`].
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Storage format.
    pub fn format(&self) -> Format {
        self.format
    }

    /// Blocks per row, `cols / 32`.
    pub fn blocks_per_row(&self) -> usize {
        self.cols / BLOCK
    }

    /// Groups of [`GROUP`] rows, the last one padded.
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP)
    }

    /// Bytes of weight data (scales, mins and quants) read by one product,
    /// the padding rows of the last group included.
    pub fn weight_bytes(&self) -> usize {
        self.groups() * GROUP * self.blocks_per_row() * self.format.block_bytes()
    }

    /// Index of group `g`'s block `b` among all group-blocks: its scales start
    /// at `16 * index`, its quants at `16 * quant_bytes * index`.
    #[inline]
    pub(crate) fn group_block(&self, g: usize, b: usize) -> usize {
        g * self.blocks_per_row() + b
    }

    /// Row `j`'s block `b`: its scale, its min (0 for Q8) and its quants as
    /// ggml stores them (Q8 as `i8` bits, Q4 as 16 nibble bytes).
    pub(crate) fn block(&self, j: usize, b: usize) -> (u16, u16, [u8; 32]) {
        let (g, r) = (j / GROUP, j % GROUP);
        let at = self.group_block(g, b);
        let qb = self.format.quant_bytes();
        let base = at * GROUP * qb;
        let mut q = [0u8; 32];
        for (s, seg) in q[..qb].chunks_exact_mut(4).enumerate() {
            let from = base + s * GROUP * 4 + r * 4;
            seg.copy_from_slice(&self.quants[from..from + 4]);
        }
        if self.format == Format::Q8 {
            q.iter_mut().for_each(|v| *v ^= 0x80);
        }
        let min = if self.format == Format::Q4 {
            self.mins[at * GROUP + r]
        } else {
            0
        };
        (self.scales[at * GROUP + r], min, q)
    }
}

/// Blocks in plain row-major order, as conversions produce them; turned into
/// a [`QMatrix`] by [`RowMajor::interleave`].
pub(crate) struct RowMajor {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) format: Format,
    /// f16 bits of each block's `d`, row-major.
    pub(crate) scales: Vec<u16>,
    /// f16 bits of each block's `m` (Q4 only).
    pub(crate) mins: Vec<u16>,
    /// Quants as ggml stores them, `format.quant_bytes()` per block.
    pub(crate) quants: Vec<u8>,
}

impl RowMajor {
    /// An empty matrix of the given format and shape, with storage reserved.
    pub(crate) fn with_capacity(format: Format, rows: usize, cols: usize) -> RowMajor {
        let blocks = rows * cols / BLOCK;
        RowMajor {
            rows,
            cols,
            format,
            scales: Vec::with_capacity(blocks),
            mins: Vec::with_capacity(if format == Format::Q4 { blocks } else { 0 }),
            quants: Vec::with_capacity(blocks * format.quant_bytes()),
        }
    }

    /// The same blocks, interleaved in groups of [`GROUP`] rows (padding rows
    /// all zero).
    pub(crate) fn interleave(self) -> QMatrix {
        let nb = self.cols / BLOCK;
        let groups = self.rows.div_ceil(GROUP);
        let qb = self.format.quant_bytes();
        let q4 = self.format == Format::Q4;
        let offset = if q4 { 0 } else { 0x80 };
        let mut scales = vec![0u16; groups * nb * GROUP];
        let mut mins = vec![0u16; if q4 { scales.len() } else { 0 }];
        let mut quants = vec![offset; groups * nb * GROUP * qb];
        for j in 0..self.rows {
            let (g, r) = (j / GROUP, j % GROUP);
            for b in 0..nb {
                let src = j * nb + b;
                let at = g * nb + b;
                scales[at * GROUP + r] = self.scales[src];
                if q4 {
                    mins[at * GROUP + r] = self.mins[src];
                }
                let block = &self.quants[src * qb..(src + 1) * qb];
                for (s, seg) in block.chunks_exact(4).enumerate() {
                    let to = at * GROUP * qb + s * GROUP * 4 + r * 4;
                    for (t, &v) in seg.iter().enumerate() {
                        quants[to + t] = v ^ offset;
                    }
                }
            }
        }
        QMatrix {
            rows: self.rows,
            cols: self.cols,
            format: self.format,
            scales,
            mins,
            quants,
        }
    }
}
