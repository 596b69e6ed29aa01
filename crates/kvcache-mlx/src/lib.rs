//! Ollama's MLX-runner cache design on mlx-rs: per-layer caches of one live
//! sequence that page their state out to snapshots, and a prefix trie shared
//! across conversations that decides what to page in and out.
//!
//! - [`trie`]: the prefix trie and the session API engines drive. Plain Rust,
//!   written against [`kvcache_api::SnapshotCache`] only.
//! - `layers` (on macOS, or on Linux when built through `cargo xtask`): the
//!   mlx-rs layer caches.
#![deny(missing_docs)]

pub mod trie;

#[cfg(any(target_os = "macos", kvcache_mlx))]
pub mod layers;
