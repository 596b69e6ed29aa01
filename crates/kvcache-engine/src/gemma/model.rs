//! The Gemma 3 forward pass on candle: full recompute with per-layer windowed
//! masks (the reference), a batch of tokens of many sequences through a
//! [`CausalCache`] (a [`LayerGroupCache`] holding the window layers and the
//! global layers apart: see [`Gemma::new_cache`]), and one sequence through
//! per-layer caches ([`GemmaLayer`]s: what `kvcache_trie::PrefixCache`
//! drives, see [`Gemma::forward_layers`]). All three share the layer loop
//! ([`Gemma::hidden_with`]) and the attention.
//!
//! One block, `x: [n, dim]`:
//!
//! ```text
//! h = norm(x);  q = rope(qnorm(Wq h)), k = rope(knorm(Wk h)), v = Wv h
//! x = x + post_attn_norm(Wo attention(q, k, v))        window or global
//! h = ffn_norm(x);  x = x + post_ffw_norm(Wdown(gelu_tanh(Wgate h) * Wup h))
//! ```
//!
//! Shapes: queries `[n, n_heads, head_dim]`, keys and values `[n, n_kv_heads,
//! head_dim]` (what [`CausalCache::put`] takes), logits `[n, vocab_size]`.
//! RoPE rotates halves (NeoX layout: GGUF keeps Gemma's Hugging Face layout).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::{gguf_file, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor, D};
use kvcache_api::{
    Batch, CausalCache, CausalConfig, ForwardMode, LayerCache, MixedLayer, Pos, SlidingWindow, SnapshotCache,
};
use kvcache_causal::layer_cache::{CandleKv, CandleWindow};
use kvcache_causal::{CausalKvCache, LayerGroupCache, RopeLayout, RopeShift};

use super::{GemmaConfig, GemmaTokenizer};
pub use crate::attention::Attend;
use crate::attention::{self, AttentionPath};
use crate::kernels;
use crate::model::SplitMix64;
use crate::q8::Q8Matrix;
use crate::{BatchToken, EngineError, LoadProgress, Result, WeightMode};

/// A weight matrix `[out, in]` applied as `x @ W^T`.
///
/// Not the Llama's `Linear`: its few-row kernel made Gemma slower (E5 on two
/// conversations: time to first token on later turns 558 -> 623 ms, whole run
/// 15.0 -> 20.3 s), where gemm's matrix-vector path does better. (The tied
/// output head's few-row products go to [`Q8Matrix`] instead.)
#[derive(Debug, Clone)]
enum Linear {
    Dense(Tensor),
    Quant(QMatMul),
}

impl Linear {
    fn new(q: QTensor, mode: WeightMode, device: &Device) -> Result<Self> {
        Ok(match mode {
            WeightMode::F32 => Linear::Dense(q.dequantize(device)?),
            WeightMode::Quantized => Linear::Quant(QMatMul::from_qtensor(q)?),
        })
    }

    /// `x: [n, in]` to `[n, out]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Linear::Dense(w) => x.matmul(&w.t()?)?,
            Linear::Quant(q) => q.forward(x)?,
        })
    }
}

#[derive(Debug, Clone)]
struct Block {
    attn_norm: Tensor,
    wq: Linear,
    wk: Linear,
    wv: Linear,
    q_norm: Tensor,
    k_norm: Tensor,
    wo: Linear,
    post_attn_norm: Tensor,
    ffn_norm: Tensor,
    gate: Linear,
    up: Linear,
    down: Linear,
    post_ffw_norm: Tensor,
}

/// A GGUF file holding a Gemma 3 model, header read.
#[derive(Debug)]
pub struct GemmaFile {
    path: PathBuf,
    content: gguf_file::Content,
}

impl GemmaFile {
    /// Reads the header of the GGUF at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let mut file = File::open(&path).map_err(|e| EngineError::io(&path, e))?;
        let content = gguf_file::Content::read(&mut file)
            .map_err(|e| EngineError::Format(format!("{}: {e}", path.display())))?;
        Ok(GemmaFile { path, content })
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> Result<GemmaConfig> {
        GemmaConfig::from_gguf_metadata(&self.content.metadata)
    }

    /// The tokenizer of the header.
    pub fn tokenizer(&self) -> Result<GemmaTokenizer> {
        GemmaTokenizer::from_gguf_metadata(&self.content.metadata)
    }

    /// Reads every weight onto `device`.
    pub fn load(
        &self,
        device: &Device,
        mode: WeightMode,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Gemma> {
        let mut file = File::open(&self.path).map_err(|e| EngineError::io(&self.path, e))?;
        Gemma::from_gguf(&self.content, &mut file, device, mode, progress)
    }
}

/// RoPE over halves (`(x[i], x[i + d/2])` rotate together by `pos * base^(-2i/d)`).
#[derive(Debug, Clone)]
struct Rope {
    inv_freq: Arc<[f64]>,
}

impl Rope {
    fn new(head_dim: usize, base: f64) -> Self {
        let inv_freq = (0..head_dim / 2)
            .map(|i| 1.0 / base.powf(2.0 * i as f64 / head_dim as f64))
            .collect();
        Rope { inv_freq }
    }

    /// `cos` and `sin`, `[n, 1, 1, head_dim / 2]` each.
    fn tables(&self, positions: &[Pos], device: &Device) -> Result<(Tensor, Tensor)> {
        let (n, half) = (positions.len(), self.inv_freq.len());
        let mut cos = Vec::with_capacity(n * half);
        let mut sin = Vec::with_capacity(n * half);
        for &p in positions {
            for &f in self.inv_freq.iter() {
                let angle = f64::from(p) * f;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        Ok((
            Tensor::from_vec(cos, (n, 1, 1, half), device)?,
            Tensor::from_vec(sin, (n, 1, 1, half), device)?,
        ))
    }

    /// Rotates `x: [n, heads, head_dim]` row `i` by the tables' row `i`.
    fn apply(x: &Tensor, (cos, sin): &(Tensor, Tensor)) -> Result<Tensor> {
        let (n, heads, head_dim) = x.dims3()?;
        let half = head_dim / 2;
        let x = x.reshape((n, heads, 2, half))?;
        let x1 = x.narrow(2, 0, 1)?;
        let x2 = x.narrow(2, 1, 1)?;
        let o1 = (x1.broadcast_mul(cos)? - x2.broadcast_mul(sin)?)?;
        let o2 = (x2.broadcast_mul(cos)? + x1.broadcast_mul(sin)?)?;
        Ok(Tensor::cat(&[o1, o2], 2)?.reshape((n, heads, head_dim))?)
    }
}

/// One layer's cache of one live sequence: a global layer keeps every
/// position's keys and values, a window layer the last
/// [`GemmaConfig::window`] (one cache type for both, as a prefix trie needs).
pub type GemmaLayer = MixedLayer<CandleKv, CandleWindow>;

/// The Gemma 3 decoder with its weights.
#[derive(Debug, Clone)]
pub struct Gemma {
    config: GemmaConfig,
    device: Device,
    /// `[vocab_size, dim]`, f32.
    embed: Tensor,
    blocks: Vec<Block>,
    /// `[dim]`.
    norm: Tensor,
    /// The tied embedding as the output projection.
    output: Linear,
    /// With f32 weights from a Q8_0 embedding, the same projection read from
    /// its Q8_0 blocks for the few-row products of decoding and first tokens
    /// (the same values, a quarter of the bytes).
    output_q8: Option<Q8Matrix>,
    rope_window: Rope,
    rope_global: Rope,
    /// How [`hidden`](Gemma::hidden) attends through a causal cache.
    attention: AttentionPath,
}

impl Gemma {
    /// Builds the model from a parsed GGUF header and its file.
    pub fn from_gguf<R: std::io::Read + std::io::Seek>(
        content: &gguf_file::Content,
        reader: &mut R,
        device: &Device,
        mode: WeightMode,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Self> {
        let config = GemmaConfig::from_gguf_metadata(&content.metadata)?;
        let total = content.tensor_infos.len();
        let mut done = 0;
        let mut get = |name: &str, dims: &[usize]| -> Result<QTensor> {
            let t = content
                .tensor(reader, name, device)
                .map_err(|e| EngineError::Format(format!("tensor {name}: {e}")))?;
            if t.shape().dims() != dims {
                return Err(EngineError::Format(format!(
                    "{name} has shape {:?}, expected {dims:?}",
                    t.shape().dims()
                )));
            }
            done += 1;
            progress(LoadProgress { done, total });
            Ok(t)
        };
        let c = &config;
        let embed_q = get("token_embd.weight", &[c.vocab_size, c.dim])?;
        let embed = embed_q.dequantize(device)?;
        let (dim, qd, kvd, ffn, hd) = (
            c.dim,
            c.n_heads * c.head_dim,
            c.n_kv_heads * c.head_dim,
            c.ffn_dim,
            c.head_dim,
        );
        let mut blocks = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let mut lin = |name: &str, dims: [usize; 2]| -> Result<Linear> {
                Linear::new(get(&format!("blk.{l}.{name}.weight"), &dims)?, mode, device)
            };
            let (wq, wk, wv, wo) = (
                lin("attn_q", [qd, dim])?,
                lin("attn_k", [kvd, dim])?,
                lin("attn_v", [kvd, dim])?,
                lin("attn_output", [dim, qd])?,
            );
            let (gate, up, down) = (
                lin("ffn_gate", [ffn, dim])?,
                lin("ffn_up", [ffn, dim])?,
                lin("ffn_down", [dim, ffn])?,
            );
            let mut vector = |name: &str, len: usize| -> Result<Tensor> {
                Ok(get(&format!("blk.{l}.{name}.weight"), &[len])?.dequantize(device)?)
            };
            blocks.push(Block {
                attn_norm: vector("attn_norm", dim)?,
                q_norm: vector("attn_q_norm", hd)?,
                k_norm: vector("attn_k_norm", hd)?,
                post_attn_norm: vector("post_attention_norm", dim)?,
                ffn_norm: vector("ffn_norm", dim)?,
                post_ffw_norm: vector("post_ffw_norm", dim)?,
                wq,
                wk,
                wv,
                wo,
                gate,
                up,
                down,
            });
        }
        let norm = get("output_norm.weight", &[dim])?.dequantize(device)?;
        let (output, output_q8) = match mode {
            WeightMode::F32 => (Linear::Dense(embed.clone()), Q8Matrix::from_qtensor(&embed_q)?),
            WeightMode::Quantized => (Linear::Quant(QMatMul::from_qtensor(embed_q)?), None),
        };
        Ok(Gemma {
            rope_window: Rope::new(config.head_dim, config.rope_base_window),
            rope_global: Rope::new(config.head_dim, config.rope_base_global),
            config,
            device: device.clone(),
            embed,
            blocks,
            norm,
            output,
            output_q8,
            attention: AttentionPath::default(),
        })
    }

    /// A model with deterministic pseudo-random f32 weights (for tests):
    /// matrices of variance about `1 / in`, larger for queries and keys so
    /// attention is far from uniform, norm weights near 1.
    pub fn random(config: GemmaConfig, seed: u64, device: &Device) -> Result<Self> {
        config.validate()?;
        let mut rng = SplitMix64(seed);
        let mut mat = |rows: usize, cols: usize, scale: f32, offset: f32| -> Result<Tensor> {
            let data: Vec<f32> = (0..rows * cols)
                .map(|_| offset + scale * rng.next_sym())
                .collect();
            Ok(Tensor::from_vec(data, (rows, cols), device)?)
        };
        let a = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
        let c = &config;
        let (dim, qd, kvd, ffn, hd) = (
            c.dim,
            c.n_heads * c.head_dim,
            c.n_kv_heads * c.head_dim,
            c.ffn_dim,
            c.head_dim,
        );
        let embed = mat(c.vocab_size, dim, 0.3, 0.0)?;
        let mut blocks = Vec::with_capacity(c.n_layers);
        for _ in 0..c.n_layers {
            blocks.push(Block {
                attn_norm: mat(1, dim, 0.2, 1.0)?.squeeze(0)?,
                wq: Linear::Dense(mat(qd, dim, a(dim), 0.0)?),
                wk: Linear::Dense(mat(kvd, dim, a(dim), 0.0)?),
                wv: Linear::Dense(mat(kvd, dim, a(dim), 0.0)?),
                q_norm: mat(1, hd, 0.5, 2.0)?.squeeze(0)?,
                k_norm: mat(1, hd, 0.5, 2.0)?.squeeze(0)?,
                wo: Linear::Dense(mat(dim, qd, a(qd), 0.0)?),
                post_attn_norm: mat(1, dim, 0.2, 1.0)?.squeeze(0)?,
                ffn_norm: mat(1, dim, 0.2, 1.0)?.squeeze(0)?,
                gate: Linear::Dense(mat(ffn, dim, a(dim), 0.0)?),
                up: Linear::Dense(mat(ffn, dim, a(dim), 0.0)?),
                down: Linear::Dense(mat(dim, ffn, a(ffn), 0.0)?),
                post_ffw_norm: mat(1, dim, 0.2, 1.0)?.squeeze(0)?,
            });
        }
        let norm = mat(1, dim, 0.2, 1.0)?.squeeze(0)?;
        Ok(Gemma {
            rope_window: Rope::new(c.head_dim, c.rope_base_window),
            rope_global: Rope::new(c.head_dim, c.rope_base_global),
            output: Linear::Dense(embed.clone()),
            output_q8: None,
            config,
            device: device.clone(),
            embed,
            blocks,
            norm,
            attention: AttentionPath::default(),
        })
    }

    /// The same weights under other implicit choices (`config` must keep every
    /// dimension): how the tests show each choice beats its alternative.
    pub fn with_choices(&self, config: GemmaConfig) -> Result<Self> {
        let c = &self.config;
        let same = (
            c.n_layers,
            c.dim,
            c.n_heads,
            c.n_kv_heads,
            c.head_dim,
            c.ffn_dim,
            c.vocab_size,
        ) == (
            config.n_layers,
            config.dim,
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
            config.ffn_dim,
            config.vocab_size,
        );
        if !same {
            return Err(EngineError::InvalidArgument(
                "with_choices keeps the model's dimensions".into(),
            ));
        }
        config.validate()?;
        let mut m = self.clone();
        m.rope_window = Rope::new(config.head_dim, config.rope_base_window);
        m.rope_global = Rope::new(config.head_dim, config.rope_base_global);
        m.config = config;
        Ok(m)
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &GemmaConfig {
        &self.config
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Chooses how [`forward`](Self::forward) and [`hidden`](Self::hidden)
    /// attend through a causal cache (default [`AttentionPath::Paged`]); the
    /// other paths are unaffected.
    pub fn set_attention(&mut self, path: AttentionPath) {
        self.attention = path;
    }

    /// How [`forward`](Self::forward) and [`hidden`](Self::hidden) attend
    /// through a causal cache.
    pub fn attention_path(&self) -> AttentionPath {
        self.attention
    }

    /// The cache configuration of each layer group: group 0 holds the window
    /// layers (window [`GemmaConfig::window`], keeping `memory` positions of
    /// each sequence so a conversation can resume behind the window's end),
    /// group 1 the global layers (everything). `base` gives sequences,
    /// capacity and batch size.
    pub fn cache_configs(&self, base: &CausalConfig, memory: usize) -> [CausalConfig; 2] {
        let window = SlidingWindow::with_memory(self.config.window, memory.max(self.config.window));
        [base.clone().with_window(window), base.clone()]
    }

    /// A [`LayerGroupCache`] for this model on `device` (see
    /// [`cache_configs`](Self::cache_configs)), each group shifting keys with
    /// its own RoPE base.
    pub fn new_cache(&self, base: &CausalConfig, memory: usize, device: &Device) -> Result<LayerGroupCache> {
        let c = &self.config;
        let [window, global] = self.cache_configs(base, memory);
        let shift = |b: f64| -> Result<_> {
            let s = RopeShift::new(RopeLayout::NeoX, c.head_dim, b as f32)?;
            Ok(Some(Box::new(s) as Box<dyn kvcache_api::KeyShift<Tensor>>))
        };
        let groups = vec![
            CausalKvCache::new(window, device.clone(), shift(c.rope_base_window)?)?,
            CausalKvCache::new(global, device.clone(), shift(c.rope_base_global)?)?,
        ];
        let layers = (0..c.n_layers).map(|l| usize::from(c.is_global(l))).collect();
        Ok(LayerGroupCache::new(groups, layers)?)
    }

    /// Empty per-layer caches for one sequence on `device`, in layer order:
    /// [`MixedLayer::Global`] for the global layers, [`MixedLayer::Window`]
    /// (window [`GemmaConfig::window`]) for the others.
    pub fn new_layers(&self, device: &Device) -> Result<Vec<GemmaLayer>> {
        let c = &self.config;
        (0..c.n_layers)
            .map(|l| {
                Ok(match c.window_of(l) {
                    None => MixedLayer::Global(CandleKv::new(c.n_kv_heads, c.head_dim, device)),
                    Some(w) => MixedLayer::Window(CandleWindow::new(w, c.n_kv_heads, c.head_dim, device)?),
                })
            })
            .collect()
    }

    /// Logits `[n, vocab_size]` for `tokens` appended to the sequence that
    /// `layers` (one per layer, as [`new_layers`](Self::new_layers) makes
    /// them) hold: see [`hidden_layers`](Self::hidden_layers).
    pub fn forward_layers(&self, tokens: &[u32], layers: &mut [GemmaLayer]) -> Result<Tensor> {
        self.logits(&self.hidden_layers(tokens, layers)?)
    }

    /// Final normed hidden states `[n, dim]` for `tokens` at positions
    /// `offset..offset + n` of the sequence `layers` hold, appending them to
    /// every layer. A window layer's cache returns the last `W - 1` earlier
    /// positions and the new ones, masked by the window; a global layer's
    /// every position, masked by causality.
    ///
    /// Layers of another number or kind than the model's, or at different
    /// offsets, are an [`InvalidArgument`](EngineError::InvalidArgument)
    /// error before any cache changes.
    pub fn hidden_layers(&self, tokens: &[u32], layers: &mut [GemmaLayer]) -> Result<Tensor> {
        let c = &self.config;
        let offset = layers.first().map_or(0, |l| l.offset());
        let fits = layers.len() == c.n_layers
            && layers
                .iter()
                .enumerate()
                .all(|(l, cache)| cache.is_window() != c.is_global(l) && cache.offset() == offset);
        if !fits {
            return Err(EngineError::InvalidArgument(format!(
                "{} layer caches (kinds or offsets) do not fit the model's {} layers",
                layers.len(),
                c.n_layers
            )));
        }
        let n = tokens.len();
        let end = offset + n;
        let positions: Vec<Pos> = (offset as Pos..end as Pos).collect();
        // Every layer of one kind sees the same columns: one mask per kind.
        let mut masks: [Option<(usize, Tensor)>; 2] = [None, None];
        self.hidden_with(tokens, &positions, &mut |layer, k, v| {
            // [n, kv_heads, head_dim] -> [1, kv_heads, n, head_dim]
            let as_update = |t: &Tensor| t.transpose(0, 1).and_then(|t| t.unsqueeze(0));
            let (keys, values) = layers[layer].update(&as_update(k)?, &as_update(v)?)?;
            let (keys, values) = (keys.squeeze(0)?, values.squeeze(0)?); // [kv_heads, cells, head_dim]
            let cells = keys.dim(1)?;
            let window = c.window_of(layer);
            let mask = match &masks[usize::from(window.is_some())] {
                Some((m, mask)) if *m == cells => mask.clone(),
                _ => {
                    let key_pos: Vec<Pos> = ((end - cells) as Pos..end as Pos).collect();
                    let mask = causal_mask(&positions, &key_pos, window, &self.device)?;
                    masks[usize::from(window.is_some())] = Some((cells, mask.clone()));
                    mask
                }
            };
            Ok(Attend {
                keys: keys.transpose(0, 1)?,
                values: values.transpose(1, 2)?,
                mask,
                permuted: true,
            })
        })
    }

    /// Logits `[n, vocab_size]` for `tokens` as one sequence at positions
    /// `0..n`, recomputed without a cache: window layers see the last
    /// `window` positions, global layers everything before.
    pub fn forward_full(&self, tokens: &[u32]) -> Result<Tensor> {
        self.logits(&self.hidden_full(tokens)?)
    }

    /// Final normed hidden states `[n, dim]` of [`forward_full`](Self::forward_full).
    pub fn hidden_full(&self, tokens: &[u32]) -> Result<Tensor> {
        let n = tokens.len();
        if n == 0 {
            return Err(EngineError::InvalidArgument("no tokens".into()));
        }
        let positions: Vec<Pos> = (0..n as Pos).collect();
        let window_mask = causal_mask(&positions, &positions, Some(self.config.window), &self.device)?;
        let global_mask = causal_mask(&positions, &positions, None, &self.device)?;
        self.hidden_with(tokens, &positions, &mut |layer, k, v| {
            let mask = if self.config.is_global(layer) {
                &global_mask
            } else {
                &window_mask
            };
            Ok(Attend {
                keys: k.clone(),
                values: v.clone(),
                mask: mask.clone(),
                permuted: false,
            })
        })
    }

    /// Logits `[n, vocab_size]` for a batch of tokens of any sequences through
    /// `cache` (e.g. [`new_cache`](Self::new_cache)'s): one `start_forward`,
    /// then per layer `set_layer`, `put` and `get_paged` (or `get`: see
    /// [`set_attention`](Self::set_attention)).
    pub fn forward<C>(&self, batch: &[BatchToken], cache: &mut C) -> Result<Tensor>
    where
        C: CausalCache<Tensor = Tensor> + ?Sized,
    {
        self.logits(&self.hidden(batch, cache)?)
    }

    /// Final normed hidden states `[n, dim]` of [`forward`](Self::forward).
    pub fn hidden<C>(&self, batch: &[BatchToken], cache: &mut C) -> Result<Tensor>
    where
        C: CausalCache<Tensor = Tensor> + ?Sized,
    {
        let b = Batch::from_tokens(batch.iter().map(|t| (t.seq, t.pos)))?;
        let tokens: Vec<u32> = batch.iter().map(|t| t.token).collect();
        self.check_tokens(&tokens)?;
        cache.start_forward(&b, ForwardMode::Compute)?;
        let (path, scale) = (self.attention, self.config.attn_scale as f32);
        self.layers(&tokens, b.positions(), &mut |layer, q, k, v| {
            attention::cached_attention(cache, path, layer, q, k, v, scale)
        })
    }

    /// The layer loop, with the attention context left to the caller:
    /// `context(layer, keys, values)` gets this pass's roped keys and values
    /// `[n, kv_heads, head_dim]` and returns what the queries attend over.
    /// Returns the final normed hidden states `[n, dim]`.
    pub fn hidden_with(
        &self,
        tokens: &[u32],
        positions: &[Pos],
        context: &mut dyn FnMut(usize, &Tensor, &Tensor) -> Result<Attend>,
    ) -> Result<Tensor> {
        let scale = self.config.attn_scale as f32;
        self.layers(tokens, positions, &mut |layer, q, k, v| {
            attention::dense_attention(q, &context(layer, k, v)?, scale)
        })
    }

    /// The layer loop: `attend(layer, q, keys, values)` gets this pass's roped
    /// queries `[n, n_heads, head_dim]`, keys and values `[n, kv_heads,
    /// head_dim]` and returns the attention's output `[n, n_heads * head_dim]`.
    /// Returns the final normed hidden states `[n, dim]`.
    fn layers(
        &self,
        tokens: &[u32],
        positions: &[Pos],
        attend: &mut dyn FnMut(usize, &Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let c = &self.config;
        let n = tokens.len();
        if n == 0 || positions.len() != n {
            return Err(EngineError::InvalidArgument(format!(
                "{n} tokens at {} positions",
                positions.len()
            )));
        }
        self.check_tokens(tokens)?;
        let ids = Tensor::from_slice(tokens, n, &self.device)?;
        let mut x = (self.embed.index_select(&ids, 0)? * c.embed_scale)?;
        let window_tables = self.rope_window.tables(positions, &self.device)?;
        let global_tables = self.rope_global.tables(positions, &self.device)?;
        for (l, block) in self.blocks.iter().enumerate() {
            let tables = if c.is_global(l) {
                &global_tables
            } else {
                &window_tables
            };
            let h = self.norm(&x, &block.attn_norm)?;
            let mut q = block.wq.forward(&h)?.reshape((n, c.n_heads, c.head_dim))?;
            let mut k = block.wk.forward(&h)?.reshape((n, c.n_kv_heads, c.head_dim))?;
            let v = block.wv.forward(&h)?.reshape((n, c.n_kv_heads, c.head_dim))?;
            if c.qk_norm {
                q = self.norm(&q, &block.q_norm)?;
                k = self.norm(&k, &block.k_norm)?;
            }
            let q = Rope::apply(&q, tables)?;
            let k = Rope::apply(&k, tables)?;
            let attn = attend(l, &q, &k, &v.contiguous()?)?;
            x = (x + self.norm(&block.wo.forward(&attn)?, &block.post_attn_norm)?)?;
            let h = self.norm(&x, &block.ffn_norm)?;
            let (g, u) = (block.gate.forward(&h)?, block.up.forward(&h)?);
            let f = kernels::gated(&g, &u, c.activation)?;
            let f = block.down.forward(&f)?;
            x = (x + self.norm(&f, &block.post_ffw_norm)?)?;
        }
        self.norm(&x, &self.norm)
    }

    /// Rotates `x: [n, heads, head_dim]` row `i` by `positions[i]` with the RoPE
    /// of layer `layer` (negative positions rotate back; rotations compose, so
    /// this also moves roped keys by a position delta).
    pub fn rope(&self, layer: usize, x: &Tensor, positions: &[Pos]) -> Result<Tensor> {
        let rope = if self.config.is_global(layer) {
            &self.rope_global
        } else {
            &self.rope_window
        };
        if x.dim(0)? != positions.len() || x.dim(2)? != 2 * rope.inv_freq.len() {
            return Err(EngineError::InvalidArgument(format!(
                "rope: x {:?} with {} positions",
                x.dims(),
                positions.len()
            )));
        }
        Rope::apply(x, &rope.tables(positions, x.device())?)
    }

    /// Logits `[n, vocab_size]` from final hidden states `[n, dim]`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        if let Some(q8) = &self.output_q8 {
            if hidden.dim(0)? <= Q8Matrix::MAX_ROWS {
                if let Some(logits) = q8.matmul_t(hidden)? {
                    return Ok(logits);
                }
            }
        }
        self.output.forward(hidden)
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        match tokens.iter().find(|&&t| t as usize >= self.config.vocab_size) {
            Some(t) => Err(EngineError::InvalidArgument(format!(
                "token {t} outside the vocabulary of {}",
                self.config.vocab_size
            ))),
            None => Ok(()),
        }
    }

    /// RMSNorm over the last dimension with weight `w + norm_offset`.
    fn norm(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
        let w = (w + self.config.norm_offset)?;
        Ok(x.broadcast_div(&(ms + self.config.rms_eps)?.sqrt()?)?
            .broadcast_mul(&w)?)
    }
}

/// The mask `[queries, keys]` (0 visible, `-inf` hidden) of queries at
/// `query_pos` over keys at `key_pos`: a key is visible when it is not later
/// and, with a window `w`, fewer than `w` positions earlier.
pub fn causal_mask(
    query_pos: &[Pos],
    key_pos: &[Pos],
    window: Option<usize>,
    device: &Device,
) -> Result<Tensor> {
    let (n, m) = (query_pos.len(), key_pos.len());
    let mut mask = vec![f32::NEG_INFINITY; n * m];
    for (i, &q) in query_pos.iter().enumerate() {
        for (j, &k) in key_pos.iter().enumerate() {
            let visible = k <= q && window.is_none_or(|w| ((q - k) as usize) < w);
            if visible {
                mask[i * m + j] = 0.0;
            }
        }
    }
    Ok(Tensor::from_vec(mask, (n, m), device)?)
}
