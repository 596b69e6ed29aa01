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
//! A [`QMatrix`] stores its blocks as a *structure of arrays*, each array in
//! row-major block order: `scales` (f16 bits), `mins` (f16 bits, Q4 only) and
//! `quants` (32 bytes per Q8 block, 16 per Q4 block). Bytes per value are the
//! same as ggml's (8.5 bits for Q8, 5 bits for Q4) and a block converts back
//! to ggml bytes with [`QMatrix::to_ggml_bytes`]. The split keeps the quants
//! of consecutive blocks contiguous, so a 512-bit register loads two Q8 blocks
//! (or the nibbles of two Q4 blocks) with one unaligned load, without the
//! 2-byte scale headers of the interleaved ggml layout in the way, and the Q4
//! `m` term (a float dot product over blocks) reads `mins` contiguously. Rows
//! are not interleaved: the kernels instead tile several weight rows and
//! activation rows per call, which already loads each weight block once per
//! tile; interleaving would make slicing rows (for a parallel split) awkward
//! for no measured gain at these sizes.
//!
//! Activations ([`QActivations`]) are quantized per row and per 32-block to
//! `i8` with an f32 scale `d = absmax / 127` and the block sum `s = d * sum(q)`.
//!
//! # Product
//!
//! `y[i][j] = sum_b d_w[j,b] * d_a[i,b] * isum_b + m_w[j,b] * s_a[i,b]`, with
//! the integer block dot product `isum_b` computed exactly. Within one [`Isa`],
//! every output value is accumulated with the same operations in the same
//! order whatever the batch size, tile position and thread split, so results
//! are bit-identical between a row computed alone and inside any batch.

mod activations;
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

/// A `rows x cols` weight matrix in 32-value quantized blocks (see the module
/// documentation for the layout).
#[derive(Clone, Debug, PartialEq)]
pub struct QMatrix {
    rows: usize,
    cols: usize,
    format: Format,
    /// f16 bits of each block's `d`, `rows * cols / 32` entries, row-major.
    scales: Vec<u16>,
    /// f16 bits of each block's `m` (Q4 only; empty for Q8).
    mins: Vec<u16>,
    /// Quants, `format.quant_bytes()` per block, row-major.
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

    /// Bytes of weight data (scales, mins and quants) read by one product.
    pub fn weight_bytes(&self) -> usize {
        self.rows * self.blocks_per_row() * self.format.block_bytes()
    }
}
