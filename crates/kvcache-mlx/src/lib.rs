//! Ollama's MLX-runner cache design on mlx-rs: per-layer caches of one live
//! sequence that page their state out to snapshots, for the prefix trie of
//! `kvcache-trie` (`kvcache_trie::PrefixCache`) to page in and out.
//!
//! - `layers` (on macOS, or on Linux when built through `cargo xtask`): the
//!   mlx-rs layer caches, each a [`kvcache_api::SnapshotCache`] and
//!   [`kvcache_api::LayerCache`].
#![deny(missing_docs)]

#[cfg(any(target_os = "macos", kvcache_mlx))]
pub mod layers;
