//! Chat on the mlx-rs models of `kvcache_models::mlx`, through the
//! `kvcache_mlx` layer caches under the `kvcache_trie` prefix trie (`--backend mlx`).
//!
//! - [`chat`]: [`MlxChat`], multi-conversation chat through
//!   [`kvcache_trie::PrefixCache`] for either model ([`kvcache_models::LayerModel`]),
//!   over mlx `KvCache`s for the Llama.
//! - [`gemma`]: [`MlxGemmaChat`], Gemma 3's chat through the same trie
//!   (rotating caches for the window layers).
//!
//! Compiled on macOS, and on Linux with `--cfg kvcache_mlx` (what `cargo xtask`
//! passes together with the patched mlx-sys), like `kvcache_mlx::layers`.

pub mod chat;
pub mod gemma;

pub use chat::MlxChat;
pub use gemma::MlxGemmaChat;
