//! Llama hyper-parameters, read from a GGUF header or chosen for tests.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;

use crate::gguf::Metadata;
use crate::{ModelError, Result};

/// The shape of a Llama-architecture model (RoPE, grouped-query attention,
/// RMSNorm, SwiGLU feed-forward, tied or separate output projection).
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// Width of the residual stream (`embedding_length`).
    pub dim: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention: `n_heads` is a multiple of it).
    pub n_kv_heads: usize,
    /// Width of one head; `dim == n_heads * head_dim`.
    pub head_dim: usize,
    /// Hidden width of the SwiGLU feed-forward.
    pub ffn_dim: usize,
    /// Vocabulary size (rows of the token embedding).
    pub vocab_size: usize,
    /// RoPE frequency base.
    pub rope_base: f64,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// Longest context the model was trained for.
    pub context_length: usize,
}

impl LlamaConfig {
    /// SmolLM2-135M-Instruct's shape (what its GGUF header says).
    pub fn smollm2_135m() -> Self {
        LlamaConfig {
            n_layers: 30,
            dim: 576,
            n_heads: 9,
            n_kv_heads: 3,
            head_dim: 64,
            ffn_dim: 1536,
            vocab_size: 49152,
            rope_base: 100_000.0,
            // The header stores 1e-5 as an f32.
            rms_eps: f64::from(1e-5f32),
            context_length: 8192,
        }
    }

    /// A tiny Llama for fast property tests: 2 layers, dim 32, 4 heads, 2 KV heads,
    /// head dim 8, FFN 64, vocabulary 64.
    pub fn tiny() -> Self {
        LlamaConfig {
            n_layers: 2,
            dim: 32,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 8,
            ffn_dim: 64,
            vocab_size: 64,
            rope_base: 10_000.0,
            rms_eps: 1e-5,
            context_length: 512,
        }
    }

    /// Query heads per key/value head.
    pub fn group_size(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    /// Checks that the dimensions fit together.
    pub fn validate(&self) -> Result<()> {
        let ok = self.n_layers > 0
            && self.n_heads > 0
            && self.n_kv_heads > 0
            && self.n_heads.is_multiple_of(self.n_kv_heads)
            && self.head_dim.is_multiple_of(2)
            && self.head_dim > 0
            && self.dim == self.n_heads * self.head_dim
            && self.vocab_size > 0
            && self.ffn_dim > 0;
        if ok {
            Ok(())
        } else {
            Err(ModelError::Format(format!("inconsistent Llama config {self:?}")))
        }
    }

    /// Reads the `llama.*` keys of a GGUF header.
    pub fn from_gguf_metadata(md: &HashMap<String, Value>) -> Result<Self> {
        let md = Metadata::of(md, "llama")?;
        let dim = md.usize("embedding_length")?;
        let n_heads = md.usize("attention.head_count")?;
        let config = LlamaConfig {
            n_layers: md.usize("block_count")?,
            dim,
            n_heads,
            n_kv_heads: md.usize("attention.head_count_kv").unwrap_or(n_heads),
            head_dim: md.usize("rope.dimension_count").unwrap_or(dim / n_heads.max(1)),
            ffn_dim: md.usize("feed_forward_length")?,
            vocab_size: md.usize("vocab_size").or_else(|_| md.token_count())?,
            rope_base: f64::from(md.f32("rope.freq_base").unwrap_or(10_000.0)),
            rms_eps: f64::from(md.f32("attention.layer_norm_rms_epsilon")?),
            context_length: md.usize("context_length").unwrap_or(2048),
        };
        config.validate()?;
        Ok(config)
    }
}
