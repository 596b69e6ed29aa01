//! Gemma 3 (the 270M model as GGUF) on candle: a model with two kinds of
//! layers, sliding-window and global, through [`kvcache_causal::LayerGroupCache`].
//!
//! - [`config`]: the hyper-parameters, the header's and the implicit ones.
//! - [`tokenizer`]: the SentencePiece-style tokenizer of the GGUF and the turn format.
//! - [`model`]: the forward pass, full recompute and through a cache.

pub mod config;
pub mod model;
pub mod tokenizer;

pub use config::{Activation, GemmaConfig};
pub use model::{causal_mask, Attend, Gemma, GemmaFile};
pub use tokenizer::{chat_turn, GemmaTokenizer, TokenKind};
