//! The E1 chat trace (`fixtures/e1_trace.json`): 10 conversations x 8 turns,
//! interleaved round-robin, each request's ChatML prompt with its SmolLM2 token ids.

use std::path::Path;

use kvcache_engine::{EngineError, Result};
use serde::Deserialize;

/// One scripted turn of a conversation.
#[derive(Debug, Clone, Deserialize)]
pub struct Turn {
    /// The user's message.
    pub user: String,
    /// The scripted assistant reply (used as history for later turns).
    pub assistant: String,
}

/// One request of the trace, in the order an engine receives them.
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
    /// Tokens to generate greedily (then discard).
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

/// The whole trace.
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
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| EngineError::io(path, e))?;
        serde_json::from_str(&text).map_err(|e| EngineError::Format(format!("{}: {e}", path.display())))
    }

    /// Sum of all prompt lengths.
    pub fn total_prompt_tokens(&self) -> usize {
        self.requests.iter().map(|r| r.prompt_tokens).sum()
    }

    /// Sum of the minimum prefill over all requests.
    pub fn total_min_prefill(&self) -> usize {
        self.requests.iter().map(|r| r.min_prefill).sum()
    }
}
