//! An OpenAI-compatible HTTP server on the kvcache-rs engine: the reference
//! integration of the crates, as an engine author would deploy them.
//!
//! - [`worker`]: one thread owns the model (SmolLM2, or Gemma 3 with its
//!   window layers in a `LayerGroupCache`) and the causal cache and
//!   runs continuous batching: every running request decodes in the same
//!   forward pass, requests join and leave between passes, a request whose
//!   client went away is cancelled and its cells freed.
//! - Prefix reuse: finished sequences stay in the cache; a new request starts
//!   from the longest prefix of its prompt held by a sequence with the same
//!   `cache_salt` and reports it as `usage.prompt_tokens_details.cached_tokens`.
//!   Two salts never share cells.
//! - [`routes`]: `POST /v1/chat/completions`, `POST /v1/completions`
//!   (streamed as server-sent events or not), `GET /v1/models`, `GET /health`,
//!   `GET /metrics` ([`metrics`], OpenMetrics text through `prometheus-client`); `/health` answers 503
//!   once the engine thread has ended.
//! - [`connections`]: the accept loop: a timeout for every phase of a
//!   connection (headers, body, idle), a bound on open connections.
//! - [`access`]: an `x-request-id` on every response and one access log line
//!   per request (`tracing`, target `kvcache_server::access`); [`body`]: the
//!   response body that tells both the connection and the log line its end.
//! - [`generation`]: a request's options checked, its tokens turned into text
//!   (stop sequences across token boundaries); [`openai`]: the bodies;
//!   [`error`]: OpenAI-style errors (`{"error": {...}}`, 503 with
//!   `Retry-After` when the queue is full).
#![deny(missing_docs)]

pub mod access;
pub mod body;
pub mod config;
pub mod connections;
pub mod error;
pub mod generation;
pub mod metrics;
pub mod openai;
pub mod routes;
pub mod worker;

use std::sync::Arc;

use kvcache_models::loader::ModelSource;
use kvcache_models::Tokenizer;

pub use config::ServerConfig;
pub use error::ApiError;
pub use routes::router;
pub use worker::Worker;

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    /// The engine thread.
    pub worker: Worker,
    /// The model's tokenizer and chat template.
    pub tokenizer: Arc<dyn Tokenizer>,
    /// Limits and names.
    pub config: Arc<ServerConfig>,
    /// The server's counters.
    pub metrics: Arc<metrics::Metrics>,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("worker", &self.worker)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl AppState {
    /// Loads the model of `source` (a Llama such as SmolLM2, or Gemma 3: the
    /// loader read which from the header) on `config.device` with
    /// `config.weights`, starts the engine thread over it and returns the
    /// state the routes serve from. A device this build or machine lacks, or
    /// weights it cannot hold, fail here, before any weight is read.
    pub fn load(source: ModelSource, config: ServerConfig) -> kvcache_engine::Result<AppState> {
        let device = config.device.open()?;
        let loaded = source.load(&device, config.weights, &mut |_| {})?;
        let tokenizer = loaded.tokenizer();
        let worker = Worker::start(loaded, &config)?;
        Ok(AppState {
            worker,
            tokenizer,
            config: Arc::new(config),
            metrics: Arc::default(),
        })
    }
}
