//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod simple_cache;

use candle_core::Tensor;

/// Largest absolute difference between two tensors of the same shape.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    kvcache_engine::check::max_abs_diff(a, b).unwrap()
}
