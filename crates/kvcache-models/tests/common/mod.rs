//! Helpers shared by the integration tests (the engine's tests compile these
//! files too, from its own `common`).
#![allow(dead_code)]

pub mod check;
pub mod simple_cache;
pub mod testing;

use candle_core::Tensor;

/// Largest absolute difference between two tensors of the same shape.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    testing::max_abs_diff(a, b)
}
