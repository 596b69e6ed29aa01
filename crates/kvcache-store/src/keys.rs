//! Block keys, vLLM's prefix-caching design: a prompt is cut into blocks of
//! `block_tokens` tokens, and the key of block `k` is a SHA-256 over the
//! domain tag, the [`Scope`](crate::Scope) (model fingerprint, tagged and
//! length-prefixed namespace), the key of block `k - 1` and the block's tokens,
//! so equal keys mean equal tokens from offset 0 on. The keys live in
//! [`kvcache_api::block_key`], shared with the causal cache's block index;
//! this module re-exports them where the store's users have always found them.

pub use kvcache_api::block_key::{BlockKey, KeyChain, DOMAIN};
