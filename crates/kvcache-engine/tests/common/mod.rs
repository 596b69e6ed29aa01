//! Helpers shared by the integration tests: the engine's own (`engine_run`)
//! and the models crate's (its checker, its simple cache and `testing`),
//! compiled here from their files there.
#![allow(dead_code)]

#[path = "../../../kvcache-models/tests/common/check.rs"]
pub mod check;
pub mod engine_run;
pub mod letters;
#[path = "../../../kvcache-models/tests/common/simple_cache.rs"]
pub mod simple_cache;
#[path = "../../../kvcache-models/tests/common/testing.rs"]
pub mod testing;

use candle_core::Tensor;

/// Largest absolute difference between two tensors of the same shape.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    testing::max_abs_diff(a, b)
}
