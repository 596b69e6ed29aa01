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
use kvcache_causal::RopeLayout;
use kvcache_mlx::layers::KvCache;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::ops::{concatenate, sigmoid, softmax_axis};
use mlx_rs::{fast, Array};

use super::mlx_err;
use super::weights::HostWeights;
use crate::llama::{block_weights, outer_weights};
use crate::weights::WeightSpec;
use crate::{LayerModel, LlamaConfig, LoadProgress, ModelError, ModelFile, Result, Rope};

/// `n` as an mlx dimension.
pub(crate) fn dim(n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| ModelError::InvalidArgument(format!("{n} exceeds mlx's i32 dimensions")))
}

/// A weight as an mlx array of `shape` holding `data` (row-major), evaluated.
pub(crate) fn weight_array(data: &[f32], shape: &[usize]) -> Result<Array> {
    let shape = shape.iter().map(|&d| dim(d)).collect::<Result<Vec<_>>>()?;
    let a = Array::from_slice(data, &shape);
    a.eval().map_err(mlx_err)?;
    Ok(a)
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
    /// The candle model's RoPE (interleaved), whose tables this model rotates by.
    rope: Rope,
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
        let get = |w: &WeightSpec| -> Result<Array> {
            let t = weights.expect(&w.name, &w.shape)?;
            weight_array(&t.data, &t.shape)
        };
        let [embed, norm, output] = outer_weights(&c);
        let embed = get(&embed)?;
        let mut blocks = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let [attn_norm, wq, wk, wv, wo, ffn_norm, gate, up, down] = block_weights(&c, l).map(|w| get(&w));
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
        let norm = get(&norm)?;
        let output = match weights.get(&output.name) {
            Some(_) => get(&output)?,
            None => embed.clone(), // tied embeddings
        };
        Ok(MlxLlama {
            rope: Rope::new(c.head_dim, c.rope_base),
            config: c,
            embed,
            blocks,
            norm,
            output,
        })
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
    /// row, with [`crate::argmax`]: the first of equal maxima).
    pub fn next_token(&self, hidden: &Array) -> Result<u32> {
        Ok(crate::argmax(&self.last_logits(hidden)?))
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
        let tables = rope_tables(&self.rope, offset, n)?;
        let mask = (n > 1).then(|| attention_mask(offset, n, None)).transpose()?;
        let eps = c.rms_eps as f32;
        let scale = (1.0 / (c.head_dim as f64).sqrt()) as f32;
        for (l, b) in self.blocks.iter().enumerate() {
            let h = fast::rms_norm(&x, Some(&b.attn_norm), eps).map_err(mlx_err)?;
            let q = linear(&h, &b.wq)?.reshape(&[ni, heads, hd]).map_err(mlx_err)?;
            let k = linear(&h, &b.wk)?.reshape(&[ni, kv_heads, hd]).map_err(mlx_err)?;
            let v = linear(&h, &b.wv)?.reshape(&[ni, kv_heads, hd]).map_err(mlx_err)?;
            let q = rope(&q, &tables, RopeLayout::Normal)?;
            // [n, kv_heads, hd] -> [1, kv_heads, n, hd]
            let to_cache = |t: &Array| t.transpose_axes(&[1, 0, 2])?.expand_dims(0);
            let k = to_cache(&rope(&k, &tables, RopeLayout::Normal)?).map_err(mlx_err)?;
            let v = to_cache(&v).map_err(mlx_err)?;
            let (keys, values) = attend(l, &k, &v)?;
            for (t, what) in [(&keys, "keys"), (&values, "values")] {
                if t.shape() != [1, kv_heads, dim(total)?, hd] {
                    return Err(ModelError::InvalidArgument(format!(
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

/// `cos` and `sin` of `rope` for positions `offset..offset + n` (the
/// numbers the candle model rotates by), shaped for [`rope`]: `[n, 1,
/// head_dim / 2, 1]` each in the interleaved layout, `[n, 1, head_dim / 2]`
/// over halves.
pub(crate) fn rope_tables(rope: &Rope, offset: usize, n: usize) -> Result<(Array, Array)> {
    let end = offset + n;
    let end = Pos::try_from(end).map_err(|_| ModelError::InvalidArgument(format!("position {end}")))?;
    let (cos, sin) = rope.cos_sin(offset as Pos..end);
    let (n, half) = (dim(n)?, dim(rope.head_dim() / 2)?);
    let shape = match rope.layout() {
        RopeLayout::Normal => vec![n, 1, half, 1],
        RopeLayout::NeoX => vec![n, 1, half],
    };
    Ok((Array::from_slice(&cos, &shape), Array::from_slice(&sin, &shape)))
}

/// RoPE on `x: [n, heads, hd]` with tables from [`rope_tables`]: in the
/// interleaved `layout` dimensions `(2i, 2i + 1)` rotate together, over halves
/// `(i, i + hd / 2)` (see [`crate::Rope`]).
pub(crate) fn rope(x: &Array, (cos, sin): &(Array, Array), layout: RopeLayout) -> Result<Array> {
    let (n, heads, hd) = (x.dim(0), x.dim(1), x.dim(2));
    let e = mlx_err;
    // The two members of each pair, along `axis`.
    let (x0, x1, axis) = match layout {
        RopeLayout::Normal => {
            let x = x.reshape(&[n, heads, hd / 2, 2]).map_err(e)?;
            let x0 = x.try_index((.., .., .., 0..1)).map_err(e)?;
            (x0, x.try_index((.., .., .., 1..2)).map_err(e)?, 3)
        }
        RopeLayout::NeoX => {
            let x0 = x.try_index((.., .., 0..hd / 2)).map_err(e)?;
            (x0, x.try_index((.., .., hd / 2..)).map_err(e)?, 2)
        }
    };
    let o0 = x0
        .multiply(cos)
        .and_then(|a| a.subtract(x1.multiply(sin)?))
        .map_err(e)?;
    let o1 = x0
        .multiply(sin)
        .and_then(|a| a.add(x1.multiply(cos)?))
        .map_err(e)?;
    let out = concatenate(&[o0, o1], axis).map_err(e)?;
    match layout {
        RopeLayout::Normal => out.reshape(&[n, heads, hd]).map_err(e),
        RopeLayout::NeoX => Ok(out),
    }
}

/// The additive mask `[n, offset + n]` (0 visible, `-inf` hidden) of `n`
/// queries at positions `offset..offset + n` over keys at `0..offset + n`: a
/// key is visible when it is not later and, with a window `w`, fewer than `w`
/// positions earlier (the window holds the query itself).
pub(crate) fn attention_mask(offset: usize, n: usize, window: Option<usize>) -> Result<Array> {
    let total = offset + n;
    let mut mask = vec![f32::NEG_INFINITY; n * total];
    for i in 0..n {
        let q = offset + i;
        let first = window.map_or(0, |w| (q + 1).saturating_sub(w));
        mask[i * total + first..=i * total + q].fill(0.0);
    }
    Ok(Array::from_slice(&mask, &[dim(n)?, dim(total)?]))
}

/// `caches` (one per layer) checked for a model of `n_layers` layers: their
/// common offset, or an `InvalidArgument` error naming what is wrong.
pub(crate) fn common_offset<L: LayerCache>(caches: &[L], n_layers: usize) -> Result<usize> {
    if caches.len() != n_layers {
        return Err(ModelError::InvalidArgument(format!(
            "{} layer caches for {n_layers} layers",
            caches.len()
        )));
    }
    let offset = caches[0].offset();
    if caches.iter().any(|l| l.offset() != offset) {
        return Err(ModelError::InvalidArgument(
            "layer caches hold different offsets".into(),
        ));
    }
    Ok(offset)
}

/// `tokens` checked for a vocabulary of `vocab_size`: not empty, every id inside.
pub(crate) fn check_tokens(tokens: &[u32], vocab_size: usize) -> Result<()> {
    if tokens.is_empty() {
        return Err(ModelError::InvalidArgument("no tokens".into()));
    }
    crate::decoder::check_tokens(tokens, vocab_size)
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

/// The Llama over `KvCache`s, which rewind to any offset.
impl LayerModel for MlxLlama {
    type Array = Array;
    type Layer = KvCache;

    const RESUMABLE: bool = false;

    fn new_layers(&self) -> Result<Vec<KvCache>> {
        Ok((0..self.config().n_layers).map(|_| KvCache::new()).collect())
    }

    fn hidden_layers(&self, tokens: &[u32], caches: &mut [KvCache]) -> Result<Array> {
        MlxLlama::hidden_layers(self, tokens, caches)
    }

    fn next_token(&self, hidden: &Array) -> Result<u32> {
        MlxLlama::next_token(self, hidden)
    }
}
