//! Gemma 3 hyper-parameters: what the GGUF header says, and what it leaves
//! implicit (checked against the model's behaviour in `tests/gemma.rs`).

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;

use crate::gguf::Metadata;
use crate::{ModelError, Result};

pub use crate::kernels::Activation;

/// The shape of a Gemma 3 text model. Window layers attend to the last
/// [`window`](Self::window) positions with RoPE base
/// [`rope_base_window`](Self::rope_base_window); every
/// [`global_every`](Self::global_every)-th layer attends to everything with
/// [`rope_base_global`](Self::rope_base_global).
#[derive(Debug, Clone, PartialEq)]
pub struct GemmaConfig {
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// Width of the residual stream.
    pub dim: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (`n_heads` is a multiple of it).
    pub n_kv_heads: usize,
    /// Width of one head (Gemma's heads are wider than `dim / n_heads`).
    pub head_dim: usize,
    /// Hidden width of the gated feed-forward.
    pub ffn_dim: usize,
    /// Vocabulary size (rows of the tied token embedding).
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// Longest context the model was trained for.
    pub context_length: usize,
    /// Positions a window layer's query sees, itself included.
    pub window: usize,
    /// Layer `l` is global when `(l + 1) % global_every == 0` (Gemma 3: 6, so
    /// layers 5, 11, 17 of 18); 1 makes every layer global.
    pub global_every: usize,
    /// RoPE base of the global layers (the header's `rope.freq_base`).
    pub rope_base_global: f64,
    /// RoPE base of the window layers (Gemma 3: 10,000; not in the header).
    pub rope_base_window: f64,
    /// Embeddings are multiplied by this (Gemma: `sqrt(dim)`).
    pub embed_scale: f64,
    /// Queries and keys go through their per-head RMSNorm before RoPE.
    pub qk_norm: bool,
    /// Added to every norm weight (0: the GGUF converter already stored
    /// Gemma's `1 + w`).
    pub norm_offset: f64,
    /// The feed-forward activation.
    pub activation: Activation,
    /// Attention scores are multiplied by this (`1 / sqrt(query_pre_attn_scalar)`,
    /// which is the head width for Gemma 3 270M).
    pub attn_scale: f64,
}

impl GemmaConfig {
    /// Reads the header of a `gemma3` GGUF; the implicit choices take Gemma 3's values.
    pub fn from_gguf_metadata(md: &HashMap<String, Value>) -> Result<Self> {
        let md = Metadata::of(md, "gemma3")?;
        let dim = md.usize("embedding_length")?;
        let head_dim = md.usize("attention.key_length")?;
        if md.usize("attention.value_length")? != head_dim {
            return Err(ModelError::Format("key and value widths differ".into()));
        }
        let config = GemmaConfig {
            n_layers: md.usize("block_count")?,
            dim,
            n_heads: md.usize("attention.head_count")?,
            n_kv_heads: md.usize("attention.head_count_kv")?,
            head_dim,
            ffn_dim: md.usize("feed_forward_length")?,
            vocab_size: md.token_count()?,
            rms_eps: f64::from(md.f32("attention.layer_norm_rms_epsilon")?),
            context_length: md.usize("context_length")?,
            window: md.usize("attention.sliding_window")?,
            global_every: 6,
            rope_base_global: f64::from(md.f32("rope.freq_base")?),
            rope_base_window: 10_000.0,
            embed_scale: (dim as f64).sqrt(),
            qk_norm: true,
            norm_offset: 0.0,
            activation: Activation::GeluTanh,
            attn_scale: 1.0 / (head_dim as f64).sqrt(),
        };
        config.validate()?;
        Ok(config)
    }

    /// A tiny Gemma for fast tests: 2 layers (a window layer of 8 positions,
    /// then a global one), dim 32, 4 query heads over 2 KV heads of width 16,
    /// FFN 64, vocabulary 64.
    pub fn tiny() -> Self {
        GemmaConfig {
            n_layers: 2,
            dim: 32,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
            ffn_dim: 64,
            vocab_size: 64,
            rms_eps: 1e-6,
            context_length: 256,
            window: 8,
            global_every: 2,
            rope_base_global: 1_000_000.0,
            rope_base_window: 10_000.0,
            embed_scale: (32f64).sqrt(),
            qk_norm: true,
            norm_offset: 0.0,
            activation: Activation::GeluTanh,
            attn_scale: 0.25,
        }
    }

    /// Whether layer `layer` attends to every position (else to the window).
    pub fn is_global(&self, layer: usize) -> bool {
        (layer + 1).is_multiple_of(self.global_every)
    }

    /// The window a layer's queries see: `None` for a global layer.
    pub fn window_of(&self, layer: usize) -> Option<usize> {
        (!self.is_global(layer)).then_some(self.window)
    }

    /// The RoPE base of a layer.
    pub fn rope_base(&self, layer: usize) -> f64 {
        if self.is_global(layer) {
            self.rope_base_global
        } else {
            self.rope_base_window
        }
    }

    /// Query heads per key/value head.
    pub fn group_size(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    /// Whether `other` has the same dimensions (layers, widths, heads,
    /// vocabulary), so the same weights fit it whatever its other choices.
    pub fn same_dims(&self, other: &GemmaConfig) -> bool {
        let dims = |c: &GemmaConfig| {
            (
                c.n_layers,
                c.dim,
                c.n_heads,
                c.n_kv_heads,
                c.head_dim,
                c.ffn_dim,
                c.vocab_size,
            )
        };
        dims(self) == dims(other)
    }

    /// Checks that the dimensions fit together.
    pub fn validate(&self) -> Result<()> {
        let ok = self.n_layers > 0
            && self.dim > 0
            && self.n_heads > 0
            && self.n_kv_heads > 0
            && self.n_heads.is_multiple_of(self.n_kv_heads)
            && self.head_dim > 0
            && self.head_dim.is_multiple_of(2)
            && self.ffn_dim > 0
            && self.vocab_size > 0
            && self.window > 0
            && self.global_every > 0;
        if ok {
            Ok(())
        } else {
            Err(ModelError::InvalidArgument(format!(
                "inconsistent Gemma config {self:?}"
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sixth_layer_is_global_with_its_own_rope_base() {
        let mut c = GemmaConfig::tiny();
        c.n_layers = 18;
        c.global_every = 6;
        let global: Vec<usize> = (0..18).filter(|&l| c.is_global(l)).collect();
        assert_eq!(global, vec![5, 11, 17]);
        assert_eq!((c.window_of(4), c.window_of(5)), (Some(8), None));
        assert_eq!((c.rope_base(0), c.rope_base(5)), (10_000.0, 1_000_000.0));
    }

    #[test]
    fn bad_shapes_are_rejected() {
        let mut c = GemmaConfig::tiny();
        c.n_kv_heads = 3;
        assert!(matches!(c.validate(), Err(ModelError::InvalidArgument(_))));
    }
}
