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

use std::fs::File;
use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::Device;
use kvcache_api::{LayerCache, MixedLayer, Pos};
use kvcache_mlx::layers::{KvCache, RotatingKvCache};
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::ops::{concatenate, sigmoid, tanh};
use mlx_rs::{fast, Array};

use super::super::mlx_err;
use super::super::model::{self, dim, linear};
use crate::gemma::{Activation, GemmaConfig};
use crate::model::SplitMix64;
use crate::{EngineError, LoadProgress, Result};

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

/// How [`MlxGemma::random`] draws a weight: `offset + scale * U[-1, 1)`.
#[derive(Clone, Copy)]
struct Draw {
    scale: f32,
    offset: f32,
}

/// `weight(name, shape, draw)` of [`MlxGemma::build`]: the weight called
/// `name` as host data of `shape`, row-major.
type WeightSource<'a> = dyn FnMut(&str, &[usize], Draw) -> Result<Vec<f32>> + 'a;

/// The per-block weights in the order the candle [`crate::gemma::Gemma::random`]
/// draws them, with their GGUF names, shapes and draws.
fn block_tensors(c: &GemmaConfig) -> [(&'static str, Vec<usize>, Draw); 13] {
    let (dim, qd, kvd, ffn, hd) = (
        c.dim,
        c.n_heads * c.head_dim,
        c.n_kv_heads * c.head_dim,
        c.ffn_dim,
        c.head_dim,
    );
    let norm = Draw {
        scale: 0.2,
        offset: 1.0,
    };
    let qk_norm = Draw {
        scale: 0.5,
        offset: 2.0,
    };
    let matrix = |fan_in: usize| Draw {
        scale: (3.0 / fan_in as f32).sqrt(),
        offset: 0.0,
    };
    [
        ("attn_norm", vec![dim], norm),
        ("attn_q", vec![qd, dim], matrix(dim)),
        ("attn_k", vec![kvd, dim], matrix(dim)),
        ("attn_v", vec![kvd, dim], matrix(dim)),
        ("attn_q_norm", vec![hd], qk_norm),
        ("attn_k_norm", vec![hd], qk_norm),
        ("attn_output", vec![dim, qd], matrix(qd)),
        ("post_attention_norm", vec![dim], norm),
        ("ffn_norm", vec![dim], norm),
        ("ffn_gate", vec![ffn, dim], matrix(dim)),
        ("ffn_up", vec![ffn, dim], matrix(dim)),
        ("ffn_down", vec![dim, ffn], matrix(ffn)),
        ("post_ffw_norm", vec![dim], norm),
    ]
}

/// A Gemma 3 text decoder on mlx-rs arrays (see the module docs).
#[derive(Clone)]
pub struct MlxGemma {
    config: GemmaConfig,
    /// `[vocab, dim]`, also the output projection (tied).
    embed: Array,
    blocks: Vec<Block>,
    /// `[dim]`.
    norm: Array,
    /// `base^(-2i / head_dim)` for `i < head_dim / 2`, in f64 like the candle model.
    inv_freq_window: Vec<f64>,
    /// The same for the global layers' base.
    inv_freq_global: Vec<f64>,
}

impl std::fmt::Debug for MlxGemma {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MlxGemma").field("config", &self.config).finish()
    }
}

impl MlxGemma {
    /// Builds the model from `weight(name, shape, draw)`, which returns the
    /// weight called `name` (GGUF naming) as host data of `shape`, asked for
    /// in the order of [`block_tensors`] (embedding first, final norm last).
    fn build(config: GemmaConfig, weight: &mut WeightSource<'_>) -> Result<Self> {
        config.validate()?;
        let c = &config;
        let offset = c.norm_offset as f32;
        let mut array = |name: &str, shape: &[usize], draw: Draw, norm: bool| -> Result<Array> {
            let mut data = weight(name, shape, draw)?;
            if norm && offset != 0.0 {
                data.iter_mut().for_each(|x| *x += offset);
            }
            let dims = shape.iter().map(|&d| dim(d)).collect::<Result<Vec<_>>>()?;
            Ok(Array::from_slice(&data, &dims))
        };
        let embed_draw = Draw {
            scale: 0.3,
            offset: 0.0,
        };
        let embed = array("token_embd.weight", &[c.vocab_size, c.dim], embed_draw, false)?;
        let mut blocks = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let mut got = Vec::with_capacity(13);
            for (name, shape, draw) in block_tensors(c) {
                let is_norm = name.ends_with("norm");
                got.push(array(&format!("blk.{l}.{name}.weight"), &shape, draw, is_norm)?);
            }
            let [attn_norm, wq, wk, wv, q_norm, k_norm, wo, post_attn_norm, ffn_norm, gate, up, down, post_ffw_norm] =
                <[Array; 13]>::try_from(got).expect("13 block tensors");
            blocks.push(Block {
                attn_norm,
                wq,
                wk,
                wv,
                q_norm,
                k_norm,
                wo,
                post_attn_norm,
                ffn_norm,
                gate,
                up,
                down,
                post_ffw_norm,
            });
        }
        let norm_draw = Draw {
            scale: 0.2,
            offset: 1.0,
        };
        let norm = array("output_norm.weight", &[c.dim], norm_draw, true)?;
        let inv_freq = |base: f64| -> Vec<f64> {
            (0..c.head_dim / 2)
                .map(|i| 1.0 / base.powf(2.0 * i as f64 / c.head_dim as f64))
                .collect()
        };
        let model = MlxGemma {
            inv_freq_window: inv_freq(c.rope_base_window),
            inv_freq_global: inv_freq(c.rope_base_global),
            embed,
            blocks,
            norm,
            config,
        };
        mlx_rs::transforms::eval(model.arrays()).map_err(mlx_err)?;
        Ok(model)
    }

    /// Reads the Gemma 3 GGUF at `path`, every weight dequantized to f32 with
    /// candle's reader (the numbers the candle model multiplies in
    /// [`crate::WeightMode::F32`]); `progress` after each tensor.
    pub fn load(path: &Path, progress: &mut dyn FnMut(LoadProgress)) -> Result<Self> {
        let mut reader = File::open(path).map_err(|e| EngineError::io(path, e))?;
        let content = gguf_file::Content::read(&mut reader)
            .map_err(|e| EngineError::Format(format!("{}: {e}", path.display())))?;
        let config = GemmaConfig::from_gguf_metadata(&content.metadata)?;
        let total = 2 + 13 * config.n_layers;
        let mut done = 0;
        MlxGemma::build(config, &mut |name, shape, _| {
            let t = content
                .tensor(&mut reader, name, &Device::Cpu)
                .and_then(|q| q.dequantize(&Device::Cpu))
                .map_err(|e| EngineError::Format(format!("tensor {name}: {e}")))?;
            if t.dims() != shape {
                return Err(EngineError::Format(format!(
                    "{name} has shape {:?}, expected {shape:?}",
                    t.dims()
                )));
            }
            done += 1;
            progress(LoadProgress { done, total });
            Ok(t.flatten_all()?.to_vec1::<f32>()?)
        })
    }

    /// A model with deterministic pseudo-random weights for tests: the same
    /// numbers as the candle [`crate::gemma::Gemma::random`] with the same
    /// `config` and `seed`, so the two are references for each other.
    pub fn random(config: GemmaConfig, seed: u64) -> Result<Self> {
        let mut rng = SplitMix64(seed);
        MlxGemma::build(config, &mut |_, shape, draw| {
            let n = shape.iter().product::<usize>();
            Ok((0..n)
                .map(|_| draw.offset + draw.scale * rng.next_sym())
                .collect())
        })
    }

    /// The same weights under other implicit choices or another window
    /// (`config` must keep every dimension and the norm offset, which the
    /// norm weights already hold), like the candle model's `with_choices`.
    pub fn with_choices(&self, config: GemmaConfig) -> Result<Self> {
        let c = &self.config;
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
        if dims(c) != dims(&config) || c.norm_offset != config.norm_offset {
            return Err(EngineError::InvalidArgument(
                "with_choices keeps the model's dimensions and norm offset".into(),
            ));
        }
        config.validate()?;
        let inv_freq = |base: f64| -> Vec<f64> {
            (0..config.head_dim / 2)
                .map(|i| 1.0 / base.powf(2.0 * i as f64 / config.head_dim as f64))
                .collect()
        };
        Ok(MlxGemma {
            inv_freq_window: inv_freq(config.rope_base_window),
            inv_freq_global: inv_freq(config.rope_base_global),
            config,
            ..self.clone()
        })
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &GemmaConfig {
        &self.config
    }

    fn arrays(&self) -> Vec<&Array> {
        let mut all = vec![&self.embed, &self.norm];
        for b in &self.blocks {
            all.extend([
                &b.attn_norm,
                &b.wq,
                &b.wk,
                &b.wv,
                &b.q_norm,
                &b.k_norm,
                &b.wo,
                &b.post_attn_norm,
                &b.ffn_norm,
                &b.gate,
                &b.up,
                &b.down,
                &b.post_ffw_norm,
            ]);
        }
        all
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
                return Err(EngineError::InvalidArgument(format!(
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
                    return Err(EngineError::InvalidArgument(format!(
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
    /// row, with [`crate::engine::argmax`]: the first of equal maxima).
    pub fn next_token(&self, hidden: &Array) -> Result<u32> {
        Ok(crate::engine::argmax(&self.last_logits(hidden)?))
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
        let window_tables = rope_tables(&self.inv_freq_window, offset, n)?;
        let global_tables = rope_tables(&self.inv_freq_global, offset, n)?;
        let eps = c.rms_eps as f32;
        let norm = |x: &Array, w: &Array| fast::rms_norm(x, Some(w), eps).map_err(e);
        for (l, b) in self.blocks.iter().enumerate() {
            let tables = if c.is_global(l) {
                &global_tables
            } else {
                &window_tables
            };
            let h = norm(&x, &b.attn_norm)?;
            let mut q = linear(&h, &b.wq)?.reshape(&[ni, heads, hd]).map_err(e)?;
            let mut k = linear(&h, &b.wk)?.reshape(&[ni, kv_heads, hd]).map_err(e)?;
            let v = linear(&h, &b.wv)?.reshape(&[ni, kv_heads, hd]).map_err(e)?;
            if c.qk_norm {
                q = norm(&q, &b.q_norm)?;
                k = norm(&k, &b.k_norm)?;
            }
            let q = rope_halves(&q, tables)?;
            // [n, kv_heads, hd] -> [1, kv_heads, n, hd]
            let to_cache = |t: &Array| t.transpose_axes(&[1, 0, 2])?.expand_dims(0);
            let k = to_cache(&rope_halves(&k, tables)?).map_err(e)?;
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

/// `cos` and `sin` of every (position, frequency) pair for positions
/// `offset..offset + n`, `[n, 1, head_dim / 2]` each, computed in f64 and
/// rounded to f32 as the candle model does.
fn rope_tables(inv_freq: &[f64], offset: usize, n: usize) -> Result<(Array, Array)> {
    let half = inv_freq.len();
    let mut cos = Vec::with_capacity(n * half);
    let mut sin = Vec::with_capacity(n * half);
    for p in offset..offset + n {
        let p = Pos::try_from(p).map_err(|_| EngineError::InvalidArgument(format!("position {p}")))?;
        for &f in inv_freq {
            let angle = f64::from(p) * f;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    let shape = [dim(n)?, 1, dim(half)?];
    Ok((Array::from_slice(&cos, &shape), Array::from_slice(&sin, &shape)))
}

/// RoPE over halves on `x: [n, heads, hd]`: `(x[i], x[i + hd/2])` rotate
/// together (the layout of Gemma's GGUF).
fn rope_halves(x: &Array, (cos, sin): &(Array, Array)) -> Result<Array> {
    let half = x.dim(2) / 2;
    let e = mlx_err;
    let x1 = x.try_index((.., .., 0..half)).map_err(e)?;
    let x2 = x.try_index((.., .., half..)).map_err(e)?;
    let o1 = x1
        .multiply(cos)
        .and_then(|a| a.subtract(x2.multiply(sin)?))
        .map_err(e)?;
    let o2 = x2
        .multiply(cos)
        .and_then(|a| a.add(x1.multiply(sin)?))
        .map_err(e)?;
    concatenate(&[o1, o2], 2).map_err(e)
}

/// The additive mask `[n, offset + n]` (0 visible, `-inf` hidden) of `n`
/// queries at positions `offset..offset + n` over keys at `0..offset + n`: a
/// key is visible when it is not later and, with a window `w`, fewer than `w`
/// positions earlier (the window holds the query itself).
fn attention_mask(offset: usize, n: usize, window: Option<usize>) -> Result<Array> {
    let total = offset + n;
    let mut mask = vec![f32::NEG_INFINITY; n * total];
    for i in 0..n {
        let q = offset + i;
        let first = window.map_or(0, |w| (q + 1).saturating_sub(w));
        mask[i * total + first..=i * total + q].fill(0.0);
    }
    Ok(Array::from_slice(&mask, &[dim(n)?, dim(total)?]))
}
