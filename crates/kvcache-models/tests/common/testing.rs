//! What the engine's tests share, unit and integration tests alike: the
//! library compiles this file as `crate::testing` under `cfg(test)`, the
//! integration tests as `common::testing` (and `gemma_common` includes it too).
//! It names nothing of the engine, so it compiles in both.
//!
//! The E1 trace read here is test data (the benchmarks' own reader, with the
//! trace's totals, is `kvcache_bench::trace`).
#![allow(dead_code)]

use std::path::Path;

use candle_core::Tensor;
use serde::Deserialize;

/// Largest absolute difference between two tensors of the same shape.
///
/// # Panics
/// When the shapes differ or candle fails.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let diff = || (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>();
    diff().expect("max |a - b|")
}

/// One scripted turn of an E1 conversation.
#[derive(Debug, Clone, Deserialize)]
pub struct Turn {
    /// The user's message.
    pub user: String,
    /// The scripted assistant reply.
    pub assistant: String,
}

/// One request of the E1 trace, in arrival order.
#[derive(Debug, Clone, Deserialize)]
pub struct Request {
    /// Index in the trace.
    pub idx: usize,
    /// Conversation id.
    pub conv: usize,
    /// Turn within the conversation, from 1.
    pub turn: usize,
    /// The full ChatML prompt.
    pub prompt: String,
    /// Tokens to generate greedily.
    pub n_predict: usize,
    /// Number of prompt tokens.
    pub prompt_tokens: usize,
    /// Longest prefix shared with any earlier prompt.
    pub best_prefix_with_earlier: usize,
    /// Tokens that must be evaluated at least (`prompt_tokens - best_prefix`, at least 1).
    pub min_prefill: usize,
    /// The prompt's token ids, as llama.cpp tokenized it.
    pub token_ids: Vec<u32>,
}

/// The E1 trace (`fixtures/e1_trace.json`, `kvcache_models::paths::e1_trace_path`).
#[derive(Debug, Clone, Deserialize)]
pub struct Trace {
    /// The shared system prompt.
    pub system: String,
    /// `conversations[c][t]`: turn `t` of conversation `c`.
    pub conversations: Vec<Vec<Turn>>,
    /// The requests in arrival order.
    pub requests: Vec<Request>,
}

impl Trace {
    /// Reads a trace file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, String> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }
}
