//! The server's limits and names.

use std::time::Duration;

use kvcache_engine::store::StoreOptions;

/// How the server sizes its engine and guards its queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// The model name clients must send (`GET /v1/models` lists it).
    pub model_name: String,
    /// Sequences the cache holds: running requests plus idle ones kept for reuse.
    pub max_sequences: usize,
    /// Positions per sequence: prompt plus generated tokens.
    pub context: usize,
    /// Most tokens in one forward pass.
    pub max_batch: usize,
    /// Longest prompt chunk of one request in one pass.
    pub prefill_chunk: usize,
    /// Requests admitted beyond `max_sequences` before new ones are refused
    /// with 503 and `Retry-After`.
    pub max_queue: usize,
    /// How long a finished sequence's cells stay cached for reuse.
    pub idle_ttl: Duration,
    /// Generated tokens when a request names no `max_tokens`.
    pub default_max_tokens: usize,
    /// The prefix store's tiers beside host memory (none: no store at all).
    pub store: StoreOptions,
    /// Evaluated prompts waiting to be written to the store before more are
    /// dropped (counted in `kvcache_store_writes_dropped_total`).
    pub store_queue: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            model_name: "SmolLM2-135M-Instruct".into(),
            max_sequences: 16,
            context: 2048,
            max_batch: 256,
            prefill_chunk: 128,
            max_queue: 64,
            idle_ttl: Duration::from_secs(300),
            default_max_tokens: 256,
            store: StoreOptions::default(),
            store_queue: 64,
        }
    }
}
