//! [`MlxLlama`]: the Llama forward pass on mlx-rs arrays, f32 throughout.
//!
//! The same model as [`crate::Llama`] (RoPE in GGUF's interleaved layout with
//! the same f64-computed tables, grouped-query attention, RMSNorm, SwiGLU), with
//! two paths: [`MlxLlama::hidden_full`] recomputes everything without a cache
//! (the reference), [`MlxLlama::hidden_layers`] appends tokens to one live
//! sequence held in per-layer caches (`kvcache_mlx::layers::KvCache`, e.g. the
//! ones a `kvcache_trie::PrefixCache` session hands out).
//!
//! Shapes (outermost first): `n` tokens flow as hidden states `[n, dim]`;
//! queries `[n, heads, head_dim]`; keys and values go to the caches as
//! `[1, kv_heads, n, head_dim]` and come back as `[1, kv_heads, total, head_dim]`;
//! logits are `[n, vocab_size]`.
//!
//! mlx is lazy: every forward function evaluates what it returns (and with it
//! every cache write of the pass) before returning, so the caches hold real
//! data and the views they returned are released.

use kvcache_api::{LayerCache, Pos};
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::ops::{concatenate, sigmoid, softmax_axis};
use mlx_rs::{fast, Array};

use super::mlx_err;
use super::weights::{block_shapes, HostTensor, HostWeights};
use crate::{EngineError, LlamaConfig, LoadProgress, ModelFile, Result};

/// `n` as an mlx dimension.
pub(crate) fn dim(n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| EngineError::InvalidArgument(format!("{n} exceeds mlx's i32 dimensions")))
}

/// An mlx array holding `t`.
fn array_of(t: &HostTensor) -> Result<Array> {
    let shape = t.shape.iter().map(|&d| dim(d)).collect::<Result<Vec<_>>>()?;
    Ok(Array::from_slice(&t.data, &shape))
}

/// `x: [n, in]` times `w: [out, in]` transposed: `[n, out]`.
pub(crate) fn linear(x: &Array, w: &Array) -> Result<Array> {
    x.matmul(w.t()).map_err(mlx_err)
}

/// `attend(layer, keys, values)` of [`MlxLlama::run`].
type Attend<'a> = dyn FnMut(usize, &Array, &Array) -> Result<(Array, Array)> + 'a;

struct Block {
    attn_norm: Array,
    wq: Array,
    wk: Array,
    wv: Array,
    wo: Array,
    ffn_norm: Array,
    gate: Array,
    up: Array,
    down: Array,
}

/// A Llama-architecture decoder on mlx-rs arrays (see the module docs).
pub struct MlxLlama {
    config: LlamaConfig,
    /// `[vocab, dim]`.
    embed: Array,
    blocks: Vec<Block>,
    /// `[dim]`.
    norm: Array,
    /// `[vocab, dim]` (the embedding itself when tied).
    output: Array,
    /// `base^(-2i / head_dim)` for `i < head_dim / 2`, in f64 like [`crate::Rope`].
    inv_freq: Vec<f64>,
}

impl std::fmt::Debug for MlxLlama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MlxLlama").field("config", &self.config).finish()
    }
}

impl MlxLlama {
    /// Builds the model from host weights (copied into mlx arrays).
    pub fn new(weights: &HostWeights) -> Result<Self> {
        let c = weights.config().clone();
        c.validate()?;
        let get = |name: &str, shape: &[usize]| -> Result<Array> { array_of(weights.expect(name, shape)?) };
        let embed = get("token_embd.weight", &[c.vocab_size, c.dim])?;
        let mut blocks = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let [attn_norm, wq, wk, wv, wo, ffn_norm, gate, up, down] =
                block_shapes(&c).map(|(name, shape)| get(&format!("blk.{l}.{name}.weight"), &shape));
            blocks.push(Block {
                attn_norm: attn_norm?,
                wq: wq?,
                wk: wk?,
                wv: wv?,
                wo: wo?,
                ffn_norm: ffn_norm?,
                gate: gate?,
                up: up?,
                down: down?,
            });
        }
        let norm = get("output_norm.weight", &[c.dim])?;
        let output = match weights.get("output.weight") {
            Some(_) => get("output.weight", &[c.vocab_size, c.dim])?,
            None => embed.clone(), // tied embeddings
        };
        let inv_freq = (0..c.head_dim / 2)
            .map(|i| 1.0 / c.rope_base.powf(2.0 * i as f64 / c.head_dim as f64))
            .collect();
        let model = MlxLlama {
            config: c,
            embed,
            blocks,
            norm,
            output,
            inv_freq,
        };
        let all = model.arrays();
        mlx_rs::transforms::eval(all).map_err(mlx_err)?;
        Ok(model)
    }

    /// Reads every weight of `file` dequantized to f32 (`progress` after each
    /// tensor) and builds the model.
    pub fn load(file: &ModelFile, progress: &mut dyn FnMut(LoadProgress)) -> Result<Self> {
        MlxLlama::new(&HostWeights::load(file, progress)?)
    }

    /// A model with [`HostWeights::random`] weights (for tests).
    pub fn random(config: LlamaConfig, seed: u64) -> Result<Self> {
        MlxLlama::new(&HostWeights::random(config, seed)?)
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    fn arrays(&self) -> Vec<&Array> {
        let mut all = vec![&self.embed, &self.norm, &self.output];
        for b in &self.blocks {
            all.extend([
                &b.attn_norm,
                &b.wq,
                &b.wk,
                &b.wv,
                &b.wo,
                &b.ffn_norm,
                &b.gate,
                &b.up,
                &b.down,
            ]);
        }
        all
    }

    /// Logits `[n, vocab_size]` for `tokens` as one sequence at positions
    /// `0..n`, recomputing everything without a cache.
    pub fn forward_full(&self, tokens: &[u32]) -> Result<Array> {
        self.logits(&self.hidden_full(tokens)?)
    }

    /// Final normed hidden states `[n, dim]` of [`forward_full`](Self::forward_full).
    pub fn hidden_full(&self, tokens: &[u32]) -> Result<Array> {
        let out = self.run(tokens, 0, &mut |_, k, v| Ok((k.clone(), v.clone())))?;
        out.eval().map_err(mlx_err)?;
        Ok(out)
    }

    /// Final normed hidden states `[n, dim]` for `tokens` appended to one live
    /// sequence held in per-layer caches (`caches[l]` for layer `l`), at
    /// positions `offset..offset + n`, `offset` being what the caches hold.
    ///
    /// Each cache's `update` must return every position it holds,
    /// `[1, kv_heads, offset + n, head_dim]` (what `kvcache_mlx::layers::KvCache`
    /// does; anything else is an error). The output and every cache write are
    /// evaluated before this returns.
    pub fn hidden_layers<L>(&self, tokens: &[u32], caches: &mut [L]) -> Result<Array>
    where
        L: LayerCache<Array = Array>,
    {
        let offset = common_offset(caches, self.config.n_layers)?;
        let out = self.run(tokens, offset, &mut |layer, k, v| Ok(caches[layer].update(k, v)?))?;
        eval_pass(out, caches)
    }

    /// Logits `[n, vocab_size]` from final hidden states `[n, dim]`, evaluated.
    pub fn logits(&self, hidden: &Array) -> Result<Array> {
        logits(hidden, &self.output)
    }

    /// Logits of the last row of hidden states `[n, dim]`, as host data.
    pub fn last_logits(&self, hidden: &Array) -> Result<Vec<f32>> {
        last_logits(hidden, &self.output)
    }

    /// The greedy next token after hidden states `[n, dim]` (from the last
    /// row, with [`crate::engine::argmax`]: the first of equal maxima).
    pub fn next_token(&self, hidden: &Array) -> Result<u32> {
        Ok(crate::engine::argmax(&self.last_logits(hidden)?))
    }

    /// The layer loop for `tokens` at positions `offset..`. `attend(layer, k, v)`
    /// receives this pass's roped keys and values `[1, kv_heads, n, head_dim]`
    /// and returns what to attend over, `[1, kv_heads, offset + n, head_dim]`.
    /// Returns the (lazy) final normed hidden states `[n, dim]`.
    fn run(&self, tokens: &[u32], offset: usize, attend: &mut Attend<'_>) -> Result<Array> {
        let c = &self.config;
        let n = tokens.len();
        check_tokens(tokens, c.vocab_size)?;
        let (ni, heads, kv_heads, hd) = (dim(n)?, dim(c.n_heads)?, dim(c.n_kv_heads)?, dim(c.head_dim)?);
        let total = offset + n;
        let ids = Array::from_slice(tokens, &[ni]);
        let mut x = self.embed.take_axis(&ids, 0).map_err(mlx_err)?;
        let tables = self.rope_tables(offset, n)?;
        let mask = causal_mask(offset, n)?;
        let eps = c.rms_eps as f32;
        let scale = (1.0 / (c.head_dim as f64).sqrt()) as f32;
        for (l, b) in self.blocks.iter().enumerate() {
            let h = fast::rms_norm(&x, Some(&b.attn_norm), eps).map_err(mlx_err)?;
            let q = linear(&h, &b.wq)?.reshape(&[ni, heads, hd]).map_err(mlx_err)?;
            let k = linear(&h, &b.wk)?.reshape(&[ni, kv_heads, hd]).map_err(mlx_err)?;
            let v = linear(&h, &b.wv)?.reshape(&[ni, kv_heads, hd]).map_err(mlx_err)?;
            let q = rope(&q, &tables)?;
            // [n, kv_heads, hd] -> [1, kv_heads, n, hd]
            let to_cache = |t: &Array| t.transpose_axes(&[1, 0, 2])?.expand_dims(0);
            let k = to_cache(&rope(&k, &tables)?).map_err(mlx_err)?;
            let v = to_cache(&v).map_err(mlx_err)?;
            let (keys, values) = attend(l, &k, &v)?;
            for (t, what) in [(&keys, "keys"), (&values, "values")] {
                if t.shape() != [1, kv_heads, dim(total)?, hd] {
                    return Err(EngineError::InvalidArgument(format!(
                        "layer {l} cache returned {what} of shape {:?}, expected [1, {kv_heads}, {total}, {hd}]",
                        t.shape()
                    )));
                }
            }
            let attn = attention(&q, &keys, &values, mask.as_ref(), c.n_kv_heads, scale)?;
            x = x.add(linear(&attn, &b.wo)?).map_err(mlx_err)?;
            let h = fast::rms_norm(&x, Some(&b.ffn_norm), eps).map_err(mlx_err)?;
            let g = linear(&h, &b.gate)?;
            let g = g.multiply(sigmoid(&g).map_err(mlx_err)?).map_err(mlx_err)?;
            let u = linear(&h, &b.up)?;
            let d = linear(&g.multiply(&u).map_err(mlx_err)?, &b.down)?;
            x = x.add(d).map_err(mlx_err)?;
        }
        fast::rms_norm(&x, Some(&self.norm), eps).map_err(mlx_err)
    }

    /// `cos` and `sin` of every (position, frequency) pair for positions
    /// `offset..offset + n`, `[n, 1, head_dim / 2, 1]` each, computed in f64 and
    /// rounded to f32 exactly as [`crate::Rope::tables`] does.
    fn rope_tables(&self, offset: usize, n: usize) -> Result<(Array, Array)> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(n * half);
        let mut sin = Vec::with_capacity(n * half);
        for p in offset..offset + n {
            let p = Pos::try_from(p).map_err(|_| EngineError::InvalidArgument(format!("position {p}")))?;
            for &f in &self.inv_freq {
                let angle = f64::from(p) * f;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        let shape = [dim(n)?, 1, dim(half)?, 1];
        Ok((Array::from_slice(&cos, &shape), Array::from_slice(&sin, &shape)))
    }
}

/// `q: [n, heads, hd]` attending over keys/values `[1, kv_heads, m, hd]`
/// under the additive `mask` `[n, m]` (none for one token), scores scaled by
/// `scale`; returns `[n, heads * hd]`. Query head `j * g + i` uses key/value
/// head `j` (`g = heads / kv_heads`).
pub(crate) fn attention(
    q: &Array,
    keys: &Array,
    values: &Array,
    mask: Option<&Array>,
    kv_heads: usize,
    scale: f32,
) -> Result<Array> {
    let (n, heads, hd) = (q.dim(0), q.dim(1), q.dim(2));
    let kvh = dim(kv_heads)?;
    let g = heads / kvh;
    let scale = Array::from_f32(scale);
    let e = mlx_err;
    // [n, heads, hd] -> [heads, n, hd] -> [kvh, g, n, hd]
    let q = q
        .transpose_axes(&[1, 0, 2])
        .and_then(|q| q.reshape(&[kvh, g, n, hd]))
        .map_err(e)?;
    // [1, kvh, m, hd] -> [kvh, 1, m, hd], broadcast over the group.
    let k = keys
        .squeeze_axes(&[0])
        .and_then(|k| k.expand_dims(1))
        .map_err(e)?;
    let v = values
        .squeeze_axes(&[0])
        .and_then(|v| v.expand_dims(1))
        .map_err(e)?;
    let scores = q
        .matmul(k.swap_axes(2, 3).map_err(e)?)
        .and_then(|s| s.multiply(&scale))
        .map_err(e)?;
    let scores = match mask {
        Some(m) => scores.add(m).map_err(e)?,
        None => scores,
    };
    let probs = softmax_axis(&scores, -1, None).map_err(e)?;
    let out = probs.matmul(&v).map_err(e)?; // [kvh, g, n, hd]
    out.reshape(&[heads, n, hd])
        .and_then(|o| o.transpose_axes(&[1, 0, 2]))
        .and_then(|o| o.reshape(&[n, heads * hd]))
        .map_err(e)
}

/// RoPE in GGUF's interleaved layout on `x: [n, heads, hd]`: dimensions
/// `(2i, 2i + 1)` rotate together (see [`crate::Rope`]).
fn rope(x: &Array, (cos, sin): &(Array, Array)) -> Result<Array> {
    let (n, heads, hd) = (x.dim(0), x.dim(1), x.dim(2));
    let e = mlx_err;
    let x = x.reshape(&[n, heads, hd / 2, 2]).map_err(e)?;
    let x0 = x.try_index((.., .., .., 0..1)).map_err(e)?;
    let x1 = x.try_index((.., .., .., 1..2)).map_err(e)?;
    let o0 = x0
        .multiply(cos)
        .and_then(|a| a.subtract(x1.multiply(sin)?))
        .map_err(e)?;
    let o1 = x0
        .multiply(sin)
        .and_then(|a| a.add(x1.multiply(cos)?))
        .map_err(e)?;
    concatenate(&[o0, o1], 3)
        .and_then(|o| o.reshape(&[n, heads, hd]))
        .map_err(e)
}

/// The additive causal mask `[n, offset + n]` for `n` queries at positions
/// `offset..offset + n` (row `i` sees columns `0..=offset + i`); `None` for a
/// single query, which sees everything.
fn causal_mask(offset: usize, n: usize) -> Result<Option<Array>> {
    if n == 1 {
        return Ok(None);
    }
    let total = offset + n;
    let mut mask = vec![0f32; n * total];
    for i in 0..n {
        mask[i * total + offset + i + 1..(i + 1) * total].fill(f32::NEG_INFINITY);
    }
    Ok(Some(Array::from_slice(&mask, &[dim(n)?, dim(total)?])))
}

/// `caches` (one per layer) checked for a model of `n_layers` layers: their
/// common offset, or an `InvalidArgument` error naming what is wrong.
pub(crate) fn common_offset<L: LayerCache>(caches: &[L], n_layers: usize) -> Result<usize> {
    if caches.len() != n_layers {
        return Err(EngineError::InvalidArgument(format!(
            "{} layer caches for {n_layers} layers",
            caches.len()
        )));
    }
    let offset = caches[0].offset();
    if caches.iter().any(|l| l.offset() != offset) {
        return Err(EngineError::InvalidArgument(
            "layer caches hold different offsets".into(),
        ));
    }
    Ok(offset)
}

/// `tokens` checked for a vocabulary of `vocab_size`: not empty, every id inside.
pub(crate) fn check_tokens(tokens: &[u32], vocab_size: usize) -> Result<()> {
    if tokens.is_empty() {
        return Err(EngineError::InvalidArgument("no tokens".into()));
    }
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab_size) {
        return Err(EngineError::InvalidArgument(format!(
            "token {t} outside the vocabulary of {vocab_size}"
        )));
    }
    Ok(())
}

/// Evaluates a pass's output `out` together with every cache's writes, and
/// returns the output.
pub(crate) fn eval_pass<L: LayerCache<Array = Array>>(out: Array, caches: &[L]) -> Result<Array> {
    let mut outputs = vec![out];
    for cache in caches {
        outputs.extend(cache.state());
    }
    mlx_rs::transforms::eval(&outputs).map_err(mlx_err)?;
    Ok(outputs.swap_remove(0))
}

/// Logits `[n, vocab]` from final hidden states `[n, dim]` and the output
/// projection `[vocab, dim]`, evaluated.
pub(crate) fn logits(hidden: &Array, output: &Array) -> Result<Array> {
    let out = linear(hidden, output)?;
    out.eval().map_err(mlx_err)?;
    Ok(out)
}

/// Logits of the last row of hidden states `[n, dim]`, as host data.
pub(crate) fn last_logits(hidden: &Array, output: &Array) -> Result<Vec<f32>> {
    let n = hidden.dim(0);
    let last = hidden.try_index(n - 1..n).map_err(mlx_err)?;
    to_host(&logits(&last, output)?)
}

/// The values of an f32 array, row-major, as host data.
pub fn to_host(a: &Array) -> Result<Vec<f32>> {
    let a = a.contiguous().map_err(mlx_err)?;
    a.eval().map_err(mlx_err)?;
    Ok(a.try_as_slice::<f32>().map_err(mlx_err)?.to_vec())
}
