//! The server's limits and names.

use std::time::Duration;

use kvcache_engine::store::StoreOptions;
use kvcache_models::attention::AttentionPath;
use kvcache_models::loader::DeviceSpec;
use kvcache_models::WeightMode;

/// Positions a window layer keeps beyond its window by default
/// ([`ServerConfig::window_memory`]): how far before a kept conversation's
/// end its next turn may part and still resume (a client sending the last
/// answer back as it came parts at the end; one that rewrites the answer's
/// last tokens, or its template's, a little before).
pub const WINDOW_MARGIN: usize = 128;

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
    /// How the model's attention reads the cache (paged by default).
    pub attention: AttentionPath,
    /// Where the model and its cache live (`--device`: the CPU by default;
    /// the packed weight modes run on the CPU only).
    pub device: DeviceSpec,
    /// How the model's weights are held and multiplied (the store's
    /// fingerprint includes it).
    pub weights: WeightMode,
    /// Positions of each sequence, and of each kept prefix, the
    /// sliding-window layers keep (a model with such layers, e.g. Gemma 3):
    /// at least the window; a conversation resumes without recomputing when
    /// its next turn parts from what the cache holds at most `window_memory -
    /// window` positions before its end. `None`: the window and
    /// [`WINDOW_MARGIN`] more.
    pub window_memory: Option<usize>,
    /// Keep finished requests' cells by blocks of this many tokens, independent
    /// of sequence ids (a model with window layers, Gemma 3, keeps every block
    /// in its global layers and, in its window layers, each kept prefix's last
    /// `window_memory` positions); `None`: keep them as idle sequences, at
    /// most `max_sequences` of them.
    pub block_tokens: Option<usize>,
    /// Publish the kept blocks as KV events in vLLM's schema on a ZMQ PUB
    /// socket bound here (`tcp://127.0.0.1:5557`), for a cache-aware router
    /// such as NVIDIA Dynamo's KV indexer (whole blocks of `block_tokens`:
    /// the block index's, or those of the idle sequences kept without one).
    pub kv_events: Option<String>,
    /// Requests admitted beyond `max_sequences` before new ones are refused
    /// with 503 and `Retry-After`.
    pub max_queue: usize,
    /// How long a finished sequence's cells stay cached for reuse (idle
    /// sequences; blocks are evicted least recently used first when cells
    /// are needed).
    pub idle_ttl: Duration,
    /// Generated tokens when a request names no `max_tokens`.
    pub default_max_tokens: usize,
    /// The prefix store's tiers beside host memory (none: no store at all).
    pub store: StoreOptions,
    /// Evaluated prompts waiting to be written to the store before more are
    /// dropped (counted in `kvcache_store_writes_dropped_total`).
    pub store_queue: usize,
    /// Tokens per block of the prefix store: what one key names, and the
    /// least a restore reads (the blocks that hold the tokens it needs).
    pub store_block_tokens: usize,
    /// The API keys `/v1` accepts (`Authorization: Bearer KEY`); empty: no
    /// key needed. Each key is its own tenant.
    pub api_keys: Vec<ApiKey>,
    /// How long a request body may take to arrive before a 408 (with
    /// `Connection: close`).
    pub body_timeout: Duration,
    /// How long a request's headers may take, from their first byte, before
    /// the connection is closed (slow clients: slowloris).
    pub header_timeout: Duration,
    /// How long a connection may stay idle (no request in progress, no byte
    /// of the next one) before it is closed; zero: one request per connection.
    pub keep_alive_timeout: Duration,
    /// Connections open at once; past it a new one is answered 503 with
    /// `Connection: close` and closed.
    pub max_connections: usize,
    /// The largest request body accepted (413 beyond).
    pub body_limit: usize,
}

/// One accepted API key and the tenant it stands for.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey {
    /// The key, as clients send it.
    pub key: String,
    /// A name for logs (`key tenant-name` in a keys file); never the key.
    pub tenant: Option<String>,
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKey")
            .field("key", &"<redacted>")
            .field("tenant", &self.tenant)
            .finish()
    }
}

impl ApiKey {
    /// The namespace prefix of the key's tenant: `k` and the first 32 hex
    /// digits (128 bits) of the key's SHA-256. Fixed-length and free of `:`,
    /// so no two keys' namespaces nest, and the key cannot be read from it.
    pub fn namespace(&self) -> String {
        use sha2::{Digest, Sha256};
        let digest = Sha256::digest(self.key.as_bytes());
        let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        format!("k{hex}")
    }

    /// Parses a keys file: one key a line, optionally followed by
    /// whitespace and a tenant name; blank lines and `#` comments skipped.
    pub fn parse_file(text: &str) -> Result<Vec<ApiKey>, String> {
        let mut keys = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut parts = line.split_whitespace();
            let key = parts.next().unwrap_or_default().to_string();
            let tenant = parts.next().map(str::to_string);
            if parts.next().is_some() {
                return Err(format!("line {}: expected `KEY [TENANT]`", i + 1));
            }
            keys.push(ApiKey { key, tenant });
        }
        Ok(keys)
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            model_name: "SmolLM2-135M-Instruct".into(),
            max_sequences: 16,
            context: 2048,
            max_batch: 256,
            prefill_chunk: 128,
            attention: AttentionPath::Paged,
            device: DeviceSpec::Cpu,
            weights: WeightMode::FASTEST,
            window_memory: None,
            block_tokens: Some(16),
            kv_events: None,
            max_queue: 64,
            idle_ttl: Duration::from_secs(300),
            default_max_tokens: 256,
            store: StoreOptions::default(),
            store_queue: 64,
            store_block_tokens: 64,
            api_keys: Vec::new(),
            body_timeout: Duration::from_secs(30),
            header_timeout: Duration::from_secs(10),
            keep_alive_timeout: Duration::from_secs(30),
            max_connections: 512,
            body_limit: 2 << 20,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_keys_file_gives_keys_and_tenants_and_namespaces_are_fixed_length() {
        let keys = ApiKey::parse_file("# keys\nsk-one alice\n\n  sk-two  \n").unwrap();
        assert_eq!(keys.len(), 2);
        assert_eq!(
            (keys[0].key.as_str(), keys[0].tenant.as_deref()),
            ("sk-one", Some("alice"))
        );
        assert_eq!(
            (keys[1].key.as_str(), keys[1].tenant.as_deref()),
            ("sk-two", None)
        );
        let (a, b) = (keys[0].namespace(), keys[1].namespace());
        assert_eq!((a.len(), b.len()), (33, 33));
        assert_ne!(a, b);
        assert!(!a.contains("sk-one") && !a.contains(':'));
        // The same key, the same tenant.
        assert_eq!(a, keys[0].clone().namespace());
        assert!(ApiKey::parse_file("k t extra").is_err());
        assert!(!format!("{:?}", keys[0]).contains("sk-one"));
    }
}
