//! Layer caches on mlx-rs arrays.
