//! Gemma 3 (the 270M model as GGUF) on candle: a model with two kinds of
//! layers, sliding-window and global, through [`kvcache_causal::LayerGroupCache`].
//!
//! - [`config`]: the hyper-parameters, the header's and the implicit ones.
//! - [`tokenizer`]: the SentencePiece-style tokenizer of the GGUF and the turn format.
//! - [`model`]: the forward pass, full recompute, through a cache, and through
//!   per-layer caches ([`GemmaLayer`]) for the prefix trie.

pub mod config;
pub mod model;
pub mod tokenizer;

pub use config::{Activation, GemmaConfig};
pub use model::{causal_mask, Attend, Gemma, GemmaFile, GemmaLayer};
pub use tokenizer::{chat_turn, GemmaTokenizer, TokenKind};

/// Environment variable holding the Gemma file's path (`cargo xtask` sets it
/// when it could prepare the model).
pub const GEMMA_ENV: &str = "KVCACHE_GEMMA";
