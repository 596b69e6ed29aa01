//! [`MlxGemma`]: the Gemma 3 forward pass on mlx-rs arrays, f32 throughout.
//!
//! The same model as the candle [`crate::gemma::Gemma`], choice for choice
//! (see [`GemmaConfig`]): embeddings scaled by `sqrt(dim)`, per-head RMS norms
//! on queries and keys before RoPE, RoPE over halves (NeoX layout) with base
//! 10,000 in the window layers and 1,000,000 in the global ones, the attention
//! scale of the config, post-attention and post-feed-forward norms, a GELU-tanh
//! gated feed-forward, and the output projection tied to the embedding. One
//! block, `x: [n, dim]`:
//!
//! ```text
//! h = norm(x);  q = rope(qnorm(Wq h)), k = rope(knorm(Wk h)), v = Wv h
//! x = x + post_attn_norm(Wo attention(q, k, v))        window or global
//! h = ffn_norm(x);  x = x + post_ffw_norm(Wdown(gelu_tanh(Wgate h) * Wup h))
//! ```
//!
//! Two paths: [`MlxGemma::hidden_full`] recomputes everything without a cache,
//! each window layer under a mask that shows a query at position `p` the keys
//! `p - W + 1 ..= p` (the project's window convention, and the candle
//! model's); [`MlxGemma::hidden_layers`] appends tokens to one live sequence
//! held in [`MlxGemmaLayer`]s, a [`KvCache`] for each global layer and a
//! [`RotatingKvCache`] of `W` slots for each window layer (see
//! [`MlxGemma::new_caches`]), such as a prefix trie's session hands out.
//!
//! Shapes (outermost first): hidden states `[n, dim]`; queries
//! `[n, heads, head_dim]`; keys and values go to the caches as
//! `[1, kv_heads, n, head_dim]`; logits are `[n, vocab_size]`.
//!
//! Every forward function evaluates what it returns (and every cache write of
//! the pass) before returning, like [`super::super::MlxLlama`].

use std::path::Path;

use candle_core::Device;
use kvcache_api::{LayerCache, MixedLayer};
use kvcache_causal::RopeLayout;
use kvcache_mlx::layers::{KvCache, RotatingKvCache, DEFAULT_STEP};
use mlx_rs::ops::{sigmoid, tanh};
use mlx_rs::{fast, Array};

use super::super::mlx_err;
use super::super::model::{self, attention_mask, dim, linear, rope, rope_tables, weight_array};
use super::super::weights::HostTensor;
use crate::gemma::model::{block_weights, outer_weights, ropes};
use crate::gemma::{Activation, GemmaConfig, GemmaFile};
use crate::gguf::Tensors;
use crate::weights::SplitMix64;
use crate::weights::WeightSpec;
use crate::{LayerModel, LoadProgress, ModelError, Result, Rope};

/// One layer's cache of an [`MlxGemma`]: a global layer keeps every position
/// in a [`KvCache`], a window layer the last `W` in a [`RotatingKvCache`].
pub type MlxGemmaLayer = MixedLayer<KvCache, RotatingKvCache>;

/// The weights of one block (GGUF names `blk.{l}.{name}.weight`); matrices
/// `[out, in]`, norm weights `[dim]` or `[head_dim]` with the config's
/// `norm_offset` already added.
#[derive(Clone)]
struct Block {
    attn_norm: Array,
    wq: Array,
    wk: Array,
    wv: Array,
    q_norm: Array,
    k_norm: Array,
    wo: Array,
    post_attn_norm: Array,
    ffn_norm: Array,
    gate: Array,
    up: Array,
    down: Array,
    post_ffw_norm: Array,
}

/// `weight(w)` of [`MlxGemma::build`]: the weight `w` as host data of its
/// shape, row-major.
type HostSource<'a> = dyn FnMut(&WeightSpec) -> Result<Vec<f32>> + 'a;

/// A Gemma 3 text decoder on mlx-rs arrays (see the module docs).
#[derive(Clone)]
pub struct MlxGemma {
    config: GemmaConfig,
    /// `[vocab, dim]`, also the output projection (tied).
    embed: Array,
    blocks: Vec<Block>,
    /// `[dim]`.
    norm: Array,
    /// The candle model's RoPEs (over halves), window layers' then global
    /// layers', whose tables this model rotates by.
    ropes: [Rope; 2],
}

impl std::fmt::Debug for MlxGemma {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MlxGemma").field("config", &self.config).finish()
    }
}

impl MlxGemma {
    /// Builds the model from `weight(w)`, which returns the weight `w` as host
    /// data, asked for in the order the candle model's random weights are
    /// drawn (the embedding first, the blocks' as [`block_weights`] lists
    /// them, the final norm last).
    fn build(config: GemmaConfig, weight: &mut HostSource<'_>) -> Result<Self> {
        config.validate()?;
        let c = &config;
        let offset = c.norm_offset as f32;
        let mut array = |w: &WeightSpec| -> Result<Array> {
            let mut data = weight(w)?;
            if w.name.ends_with("norm.weight") && offset != 0.0 {
                data.iter_mut().for_each(|x| *x += offset);
            }
            weight_array(&data, &w.shape)
        };
        let [embed, norm] = outer_weights(c);
        let embed = array(&embed)?;
        let mut blocks = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let [attn_norm, wq, wk, wv, q_norm, k_norm, wo, post_attn_norm, ffn_norm, gate, up, down, post_ffw_norm] =
                block_weights(c, l).map(|w| array(&w));
            blocks.push(Block {
                attn_norm: attn_norm?,
                wq: wq?,
                wk: wk?,
                wv: wv?,
                q_norm: q_norm?,
                k_norm: k_norm?,
                wo: wo?,
                post_attn_norm: post_attn_norm?,
                ffn_norm: ffn_norm?,
                gate: gate?,
                up: up?,
                down: down?,
                post_ffw_norm: post_ffw_norm?,
            });
        }
        let norm = array(&norm)?;
        Ok(MlxGemma {
            ropes: ropes(&config),
            embed,
            blocks,
            norm,
            config,
        })
    }

    /// Reads the Gemma 3 GGUF at `path`, every weight dequantized to f32 with
    /// candle's reader (the numbers the candle model multiplies in
    /// [`crate::WeightMode::F32`]); `progress` after each tensor.
    pub fn load(path: &Path, progress: &mut dyn FnMut(LoadProgress)) -> Result<Self> {
        let file = GemmaFile::open(path)?;
        let config = file.config()?;
        file.gguf().build(|content, reader| {
            let mut tensors = Tensors::new(content, reader, &Device::Cpu, progress);
            MlxGemma::build(config, &mut |w| {
                Ok(HostTensor::from_qtensor(&tensors.read(&w.name, &w.shape)?)?.data)
            })
        })
    }

    /// A model with deterministic pseudo-random weights for tests: the same
    /// numbers as the candle [`crate::gemma::Gemma::random`] with the same
    /// `config` and `seed` (drawn from the same specs), so the two are
    /// references for each other.
    pub fn random(config: GemmaConfig, seed: u64) -> Result<Self> {
        let mut rng = SplitMix64(seed);
        MlxGemma::build(config, &mut |w| Ok(w.draw.values(&mut rng, w.len())))
    }

    /// The same weights under other implicit choices or another window
    /// (`config` must keep every dimension and the norm offset, which the
    /// norm weights already hold), like the candle model's `with_choices`.
    pub fn with_choices(&self, config: GemmaConfig) -> Result<Self> {
        if !self.config.same_dims(&config) || self.config.norm_offset != config.norm_offset {
            return Err(ModelError::InvalidArgument(
                "with_choices keeps the model's dimensions and norm offset".into(),
            ));
        }
        config.validate()?;
        Ok(MlxGemma {
            ropes: ropes(&config),
            config,
            ..self.clone()
        })
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &GemmaConfig {
        &self.config
    }

    /// Empty caches for one live sequence, one per layer: a [`KvCache`] for
    /// each global layer, a [`RotatingKvCache`] of the config's window for
    /// each window layer (growing in steps of `step` positions).
    pub fn new_caches(&self, step: usize) -> Result<Vec<MlxGemmaLayer>> {
        let c = &self.config;
        (0..c.n_layers)
            .map(|l| {
                Ok(match c.window_of(l) {
                    None => MixedLayer::Global(KvCache::with_step(step)?),
                    Some(w) => MixedLayer::Window(RotatingKvCache::with_step(w, step)?),
                })
            })
            .collect()
    }

    /// Logits `[n, vocab_size]` for `tokens` as one sequence at positions
    /// `0..n`, recomputed without a cache.
    pub fn forward_full(&self, tokens: &[u32]) -> Result<Array> {
        self.logits(&self.hidden_full(tokens)?)
    }

    /// Final normed hidden states `[n, dim]` of [`forward_full`](Self::forward_full):
    /// window layers see the last `window` positions, global layers every
    /// earlier one.
    pub fn hidden_full(&self, tokens: &[u32]) -> Result<Array> {
        let n = tokens.len();
        let window = attention_mask(0, n, Some(self.config.window))?;
        let global = attention_mask(0, n, None)?;
        let out = self.run(tokens, 0, &mut |layer, k, v| {
            let mask = if self.config.is_global(layer) {
                &global
            } else {
                &window
            };
            Ok((k.clone(), v.clone(), Some(mask.clone())))
        })?;
        out.eval().map_err(mlx_err)?;
        Ok(out)
    }

    /// Final normed hidden states `[n, dim]` for `tokens` appended to one live
    /// sequence held in `caches` (`caches[l]` for layer `l`, as
    /// [`new_caches`](Self::new_caches) makes them), at positions
    /// `offset..offset + n`, `offset` being what the caches hold.
    ///
    /// A cache of the wrong kind for its layer, a window other than the
    /// config's, caches at different offsets, no tokens or a token outside
    /// the vocabulary is an `InvalidArgument` error that leaves every cache as
    /// it was. A cache that returns another number of positions than its kind
    /// promises (a broken cache) is one too, reported after its own write. The
    /// output and every cache write are evaluated before this returns.
    pub fn hidden_layers(&self, tokens: &[u32], caches: &mut [MlxGemmaLayer]) -> Result<Array> {
        let c = &self.config;
        let offset = model::common_offset(caches, c.n_layers)?;
        for (l, cache) in caches.iter().enumerate() {
            let fits = match (cache, c.window_of(l)) {
                (MixedLayer::Global(_), None) => true,
                (MixedLayer::Window(r), Some(w)) => r.window() == w,
                _ => false,
            };
            if !fits {
                let got = match cache {
                    MixedLayer::Global(_) => "a KvCache".to_string(),
                    MixedLayer::Window(r) => format!("a RotatingKvCache of window {}", r.window()),
                };
                let needs = match c.window_of(l) {
                    None => "a KvCache".to_string(),
                    Some(w) => format!("a RotatingKvCache of window {w}"),
                };
                return Err(ModelError::InvalidArgument(format!(
                    "layer {l} needs {needs}, got {got}"
                )));
            }
        }
        let n = tokens.len();
        let global = attention_mask(offset, n, None)?;
        let out = self.run(tokens, offset, &mut |layer, k, v| {
            let cache = &mut caches[layer];
            let (mask, cols) = match cache {
                MixedLayer::Global(_) => (n > 1).then_some(global.clone()),
                MixedLayer::Window(r) => (n > 1).then(|| r.update_mask(n)).transpose()?,
            }
            .map_or((None, None), |m| {
                let cols = m.dim(1);
                (Some(m), Some(cols))
            });
            let (keys, values) = cache.update(k, v)?;
            // One query sees everything a cache returns: the global layer's
            // `offset + 1` positions, the window layer's `min(offset + 1, W)`.
            let expected = match (cols, &*cache) {
                (Some(cols), _) => cols,
                (None, MixedLayer::Global(_)) => dim(offset + 1)?,
                (None, MixedLayer::Window(r)) => dim((offset + 1).min(r.window()))?,
            };
            for (t, what) in [(&keys, "keys"), (&values, "values")] {
                if t.dim(2) != expected {
                    return Err(ModelError::InvalidArgument(format!(
                        "layer {layer} cache returned {what} of shape {:?}, expected {expected} positions",
                        t.shape()
                    )));
                }
            }
            Ok((keys, values, mask))
        })?;
        model::eval_pass(out, caches)
    }

    /// Logits `[n, vocab_size]` from final hidden states `[n, dim]` (the output
    /// projection is the embedding), evaluated.
    pub fn logits(&self, hidden: &Array) -> Result<Array> {
        model::logits(hidden, &self.embed)
    }

    /// Logits of the last row of hidden states `[n, dim]`, as host data.
    pub fn last_logits(&self, hidden: &Array) -> Result<Vec<f32>> {
        model::last_logits(hidden, &self.embed)
    }

    /// The greedy next token after hidden states `[n, dim]` (from the last
    /// row, with [`crate::argmax`]: the first of equal maxima).
    pub fn next_token(&self, hidden: &Array) -> Result<u32> {
        Ok(crate::argmax(&self.last_logits(hidden)?))
    }

    /// The layer loop for `tokens` at positions `offset..`. `attend(layer, k, v)`
    /// receives this pass's roped keys and values `[1, kv_heads, n, head_dim]`
    /// and returns what to attend over, `[1, kv_heads, m, head_dim]` each, with
    /// the additive mask `[n, m]` (`None`: every query sees every column).
    /// Returns the (lazy) final normed hidden states `[n, dim]`.
    fn run(&self, tokens: &[u32], offset: usize, attend: &mut Attend<'_>) -> Result<Array> {
        let c = &self.config;
        let n = tokens.len();
        model::check_tokens(tokens, c.vocab_size)?;
        let e = mlx_err;
        let (ni, heads, kv_heads, hd) = (dim(n)?, dim(c.n_heads)?, dim(c.n_kv_heads)?, dim(c.head_dim)?);
        let ids = Array::from_slice(tokens, &[ni]);
        let scale = Array::from_f32(c.embed_scale as f32);
        let mut x = self
            .embed
            .take_axis(&ids, 0)
            .and_then(|x| x.multiply(&scale))
            .map_err(e)?;
        let tables = [
            rope_tables(&self.ropes[0], offset, n)?,
            rope_tables(&self.ropes[1], offset, n)?,
        ];
        let eps = c.rms_eps as f32;
        let norm = |x: &Array, w: &Array| fast::rms_norm(x, Some(w), eps).map_err(e);
        for (l, b) in self.blocks.iter().enumerate() {
            let tables = &tables[usize::from(c.is_global(l))];
            let h = norm(&x, &b.attn_norm)?;
            let mut q = linear(&h, &b.wq)?.reshape(&[ni, heads, hd]).map_err(e)?;
            let mut k = linear(&h, &b.wk)?.reshape(&[ni, kv_heads, hd]).map_err(e)?;
            let v = linear(&h, &b.wv)?.reshape(&[ni, kv_heads, hd]).map_err(e)?;
            if c.qk_norm {
                q = norm(&q, &b.q_norm)?;
                k = norm(&k, &b.k_norm)?;
            }
            let q = rope(&q, tables, RopeLayout::NeoX)?;
            // [n, kv_heads, hd] -> [1, kv_heads, n, hd]
            let to_cache = |t: &Array| t.transpose_axes(&[1, 0, 2])?.expand_dims(0);
            let k = to_cache(&rope(&k, tables, RopeLayout::NeoX)?).map_err(e)?;
            let v = to_cache(&v).map_err(e)?;
            let (keys, values, mask) = attend(l, &k, &v)?;
            let attn = model::attention(
                &q,
                &keys,
                &values,
                mask.as_ref(),
                c.n_kv_heads,
                c.attn_scale as f32,
            )?;
            x = x
                .add(norm(&linear(&attn, &b.wo)?, &b.post_attn_norm)?)
                .map_err(e)?;
            let h = norm(&x, &b.ffn_norm)?;
            let g = linear(&h, &b.gate)?;
            let g = match c.activation {
                Activation::GeluTanh => gelu_tanh(&g)?,
                Activation::Silu => g.multiply(sigmoid(&g).map_err(e)?).map_err(e)?,
            };
            let u = linear(&h, &b.up)?;
            let f = linear(&g.multiply(&u).map_err(e)?, &b.down)?;
            x = x.add(norm(&f, &b.post_ffw_norm)?).map_err(e)?;
        }
        norm(&x, &self.norm)
    }
}

/// `attend(layer, keys, values)` of [`MlxGemma::run`]: what the layer's queries
/// attend over and under which mask.
type Attend<'a> = dyn FnMut(usize, &Array, &Array) -> Result<(Array, Array, Option<Array>)> + 'a;

/// `0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`, candle's `gelu`.
fn gelu_tanh(x: &Array) -> Result<Array> {
    let e = mlx_err;
    let c = Array::from_f32((2.0 / std::f64::consts::PI).sqrt() as f32);
    let cube = x.multiply(x).and_then(|s| s.multiply(x)).map_err(e)?;
    let inner = cube
        .multiply(Array::from_f32(0.044715))
        .and_then(|t| t.add(x))
        .and_then(|t| t.multiply(&c))
        .map_err(e)?;
    tanh(&inner)
        .and_then(|t| t.add(Array::from_f32(1.0)))
        .and_then(|t| t.multiply(x))
        .and_then(|t| t.multiply(Array::from_f32(0.5)))
        .map_err(e)
}

/// Gemma over rotating window caches, which cannot rewind once wrapped: each
/// turn keeps a restore point at its prompt's end.
impl LayerModel for MlxGemma {
    type Array = Array;
    type Layer = MlxGemmaLayer;

    const RESUMABLE: bool = true;

    fn new_layers(&self) -> Result<Vec<MlxGemmaLayer>> {
        self.new_caches(DEFAULT_STEP)
    }

    fn hidden_layers(&self, tokens: &[u32], caches: &mut [MlxGemmaLayer]) -> Result<Array> {
        MlxGemma::hidden_layers(self, tokens, caches)
    }

    fn next_token(&self, hidden: &Array) -> Result<u32> {
        MlxGemma::next_token(self, hidden)
    }
}
