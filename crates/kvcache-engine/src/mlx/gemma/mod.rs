//! Gemma 3 on mlx-rs through the prefix trie.
//!
//! - [`chat`]: [`MlxGemmaChat`], multi-conversation chat through
//!   [`kvcache_trie::PrefixCache`] over [`kvcache_models::mlx::MlxGemma`]'s
//!   per-layer caches, keeping a restore point at every prompt's end so the
//!   next turn resumes there.

pub mod chat;

pub use chat::MlxGemmaChat;
