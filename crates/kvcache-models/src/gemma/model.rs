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

use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor, D};
use kvcache_api::{
    Batch, CausalCache, CausalConfig, DType, ForwardMode, KvLayout, LayerCache, MixedLayer, Pos,
    SlidingWindow, SnapshotCache,
};
use kvcache_causal::layer_cache::{CandleKv, CandleWindow};
use kvcache_causal::{CausalKvCache, LayerGroupCache, RopeLayout, RopeShift};

use super::{GemmaConfig, GemmaTokenizer};
pub use crate::attention::Attend;
use crate::attention::{self, AttentionPath};
use crate::decoder::{check_tokens, AttendFn, FeedForward, Qkv, Trunk};
use crate::gguf::{GgufFile, Tensors};
use crate::model::{LayerModel, Model};
use crate::q8::Q8Matrix;
use crate::weights::{DenseKernel, Draw, GgufWeights, Linear, RandomWeights, WeightSource, WeightSpec};
use crate::{BatchToken, LoadProgress, ModelError, Result, Rope, WeightMode};

/// Gemma's dense products: `gemm` for every number of rows.
///
/// Not the Llama's few-row kernel: it made Gemma slower (E5 on two
/// conversations: time to first token on later turns 558 -> 623 ms, whole run
/// 15.0 -> 20.3 s), where gemm's matrix-vector path does better. (The tied
/// output head's few-row products go to [`Q8Matrix`] instead.)
const KERNEL: DenseKernel = DenseKernel::Gemm;

#[derive(Debug, Clone)]
struct Block {
    attn_norm: Tensor,
    qkv: Qkv,
    q_norm: Tensor,
    k_norm: Tensor,
    wo: Linear,
    post_attn_norm: Tensor,
    ffn_norm: Tensor,
    ffn: FeedForward,
    post_ffw_norm: Tensor,
}

impl Block {
    /// Block `layer`'s weights from `source`.
    fn new(c: &GemmaConfig, layer: usize, source: &mut dyn WeightSource) -> Result<Self> {
        let [attn_norm, wq, wk, wv, q_norm, k_norm, wo, post_attn_norm, ffn_norm, gate, up, down, post_ffw_norm] =
            block_weights(c, layer);
        Ok(Block {
            attn_norm: source.tensor(&attn_norm)?,
            qkv: Qkv::new(source, [&wq, &wk, &wv])?,
            q_norm: source.tensor(&q_norm)?,
            k_norm: source.tensor(&k_norm)?,
            wo: source.linear(&wo)?,
            post_attn_norm: source.tensor(&post_attn_norm)?,
            ffn_norm: source.tensor(&ffn_norm)?,
            ffn: FeedForward::new(source, [&gate, &up, &down])?,
            post_ffw_norm: source.tensor(&post_ffw_norm)?,
        })
    }
}

/// Block `layer`'s weights, in the order [`Gemma::random`] (and the mlx
/// model's `random`, so the two hold the same numbers) draws them: matrices
/// of variance about `1 / in`, the per-head query and key norm weights near
/// 2 (attention far from uniform), the other norm weights near 1.
pub(crate) fn block_weights(c: &GemmaConfig, layer: usize) -> [WeightSpec; 13] {
    let (dim, qd, kvd, ffn, hd) = (
        c.dim,
        c.n_heads * c.head_dim,
        c.n_kv_heads * c.head_dim,
        c.ffn_dim,
        c.head_dim,
    );
    let qk_norm = Draw::new(0.5, 2.0);
    let w = |name: &str, shape: Vec<usize>, draw: Draw| WeightSpec::block(layer, name, shape, draw);
    [
        w("attn_norm", vec![dim], Draw::NORM),
        w("attn_q", vec![qd, dim], Draw::matrix(dim)),
        w("attn_k", vec![kvd, dim], Draw::matrix(dim)),
        w("attn_v", vec![kvd, dim], Draw::matrix(dim)),
        w("attn_q_norm", vec![hd], qk_norm),
        w("attn_k_norm", vec![hd], qk_norm),
        w("attn_output", vec![dim, qd], Draw::matrix(qd)),
        w("post_attention_norm", vec![dim], Draw::NORM),
        w("ffn_norm", vec![dim], Draw::NORM),
        w("ffn_gate", vec![ffn, dim], Draw::matrix(dim)),
        w("ffn_up", vec![ffn, dim], Draw::matrix(dim)),
        w("ffn_down", vec![dim, ffn], Draw::matrix(ffn)),
        w("post_ffw_norm", vec![dim], Draw::NORM),
    ]
}

/// The weights around the blocks: the token embedding (`[vocab, dim]`, also
/// the output projection, tied), drawn first, and the final norm, drawn last.
pub(crate) fn outer_weights(c: &GemmaConfig) -> [WeightSpec; 2] {
    WeightSpec::trunk(c.vocab_size, c.dim, Draw::new(0.3, 0.0))
}

/// The RoPE of the window layers and of the global layers, in that order
/// (index `usize::from(config.is_global(layer))`).
pub(crate) fn ropes(c: &GemmaConfig) -> [Rope; 2] {
    [c.rope_base_window, c.rope_base_global].map(|base| Rope::with_layout(RopeLayout::NeoX, c.head_dim, base))
}

/// A GGUF file holding a Gemma 3 model, header read.
#[derive(Debug)]
pub struct GemmaFile {
    gguf: GgufFile,
}

impl GemmaFile {
    /// Reads the header of the GGUF at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        GgufFile::open(path).map(GemmaFile::from)
    }

    /// The header, whatever the architecture.
    pub fn gguf(&self) -> &GgufFile {
        &self.gguf
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> Result<GemmaConfig> {
        GemmaConfig::from_gguf_metadata(self.gguf.metadata())
    }

    /// The tokenizer of the header.
    pub fn tokenizer(&self) -> Result<GemmaTokenizer> {
        GemmaTokenizer::from_gguf_metadata(self.gguf.metadata())
    }

    /// Reads every weight onto `device`.
    pub fn load(
        &self,
        device: &Device,
        mode: WeightMode,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Gemma> {
        self.gguf
            .build(|content, file| Gemma::from_gguf(content, file, device, mode, progress))
    }
}

/// A header already read, whatever it names (checked when the model is read).
impl From<GgufFile> for GemmaFile {
    fn from(gguf: GgufFile) -> Self {
        GemmaFile { gguf }
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
    trunk: Trunk<Block>,
    /// The tied embedding as the output projection.
    output: Linear,
    /// With f32 weights from a Q8_0 embedding, the same projection read from
    /// its Q8_0 blocks for the few-row products of decoding and first tokens
    /// (the same values, a quarter of the bytes).
    output_q8: Option<Q8Matrix>,
    /// The window layers' RoPE and the global layers' (see [`ropes`]).
    ropes: [Rope; 2],
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
        mode.check_device(device)?;
        let tensors = Tensors::new(content, reader, device, progress);
        let mut source = GgufWeights::new(tensors, mode, KERNEL, device);
        Gemma::build(config, &mut source, mode, device)
    }

    /// A model with deterministic pseudo-random f32 weights (for tests):
    /// matrices of variance about `1 / in`, query and key norm weights near 2
    /// so attention is far from uniform, the other norm weights near 1.
    pub fn random(config: GemmaConfig, seed: u64, device: &Device) -> Result<Self> {
        Gemma::random_in(config, seed, WeightMode::F32, device)
    }

    /// [`random`](Gemma::random) with the matrices held as `mode` says
    /// (drawn in f32, then converted).
    pub fn random_in(config: GemmaConfig, seed: u64, mode: WeightMode, device: &Device) -> Result<Self> {
        config.validate()?;
        mode.check_device(device)?;
        let mut source = RandomWeights::new(seed, mode, KERNEL, device);
        Gemma::build(config, &mut source, mode, device)
    }

    /// The model with weights from `source` (held as `mode` says).
    fn build(
        config: GemmaConfig,
        source: &mut dyn WeightSource,
        mode: WeightMode,
        device: &Device,
    ) -> Result<Self> {
        let [embed, norm] = outer_weights(&config);
        let block = |l, source: &mut dyn WeightSource| Block::new(&config, l, source);
        let (trunk, stored) = Trunk::new(source, (&embed, &norm), config.n_layers, block)?;
        let output_q8 = match (mode, &stored) {
            (WeightMode::F32, Some(stored)) => Q8Matrix::from_qtensor(stored)?,
            _ => None,
        };
        Ok(Gemma {
            output: Linear::tied(&trunk.embed, stored, mode, KERNEL)?,
            output_q8,
            ropes: ropes(&config),
            config,
            device: device.clone(),
            trunk,
            attention: AttentionPath::default(),
        })
    }

    /// The same weights under other implicit choices (`config` must keep every
    /// dimension): how the tests show each choice beats its alternative.
    pub fn with_choices(&self, config: GemmaConfig) -> Result<Self> {
        if !self.config.same_dims(&config) {
            return Err(ModelError::InvalidArgument(
                "with_choices keeps the model's dimensions".into(),
            ));
        }
        config.validate()?;
        let mut m = self.clone();
        m.ropes = ropes(&config);
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
    /// capacity and batch size. The window group has room for as many kept
    /// prefix tails (`memory` positions each) as there are sequences, beside
    /// the sequences' own windows ([`CausalConfig::kept_cells`]).
    pub fn cache_configs(&self, base: &CausalConfig, memory: usize) -> [CausalConfig; 2] {
        let memory = memory.max(self.config.window);
        let window = SlidingWindow::with_memory(self.config.window, memory);
        let kept = base.max_sequences.saturating_mul(memory);
        [
            base.clone().with_window(window).with_kept_cells(kept),
            base.clone(),
        ]
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
    /// offsets, are an [`InvalidArgument`](ModelError::InvalidArgument)
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
            return Err(ModelError::InvalidArgument(format!(
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
            return Err(ModelError::InvalidArgument("no tokens".into()));
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
        check_tokens(&tokens, self.config.vocab_size)?;
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

    /// The layer loop, each layer's attention by `attend` (see [`AttendFn`]).
    /// Returns the final normed hidden states `[n, dim]`.
    fn layers(&self, tokens: &[u32], positions: &[Pos], attend: &mut AttendFn<'_>) -> Result<Tensor> {
        let c = &self.config;
        let n = tokens.len();
        if n == 0 || positions.len() != n {
            return Err(ModelError::InvalidArgument(format!(
                "{n} tokens at {} positions",
                positions.len()
            )));
        }
        let mut x = (self.trunk.embed(tokens)? * c.embed_scale)?;
        let tables = [
            self.ropes[0].tables(positions, &self.device)?,
            self.ropes[1].tables(positions, &self.device)?,
        ];
        for (l, block) in self.trunk.blocks.iter().enumerate() {
            let kind = usize::from(c.is_global(l));
            let (rope, tables) = (&self.ropes[kind], &tables[kind]);
            let h = self.norm(&x, &block.attn_norm)?;
            let (mut q, mut k, v) = block.qkv.forward(&h, (c.n_heads, c.n_kv_heads, c.head_dim))?;
            if c.qk_norm {
                q = self.norm(&q, &block.q_norm)?;
                k = self.norm(&k, &block.k_norm)?;
            }
            let q = rope.apply_tables(&q, tables)?;
            let k = rope.apply_tables(&k, tables)?;
            let attn = attend(l, &q, &k, &v.contiguous()?)?;
            x = (x + self.norm(&block.wo.forward(&attn)?, &block.post_attn_norm)?)?;
            let h = self.norm(&x, &block.ffn_norm)?;
            let f = block.ffn.forward(&h, c.activation)?;
            x = (x + self.norm(&f, &block.post_ffw_norm)?)?;
        }
        self.norm(&x, &self.trunk.norm)
    }

    /// Rotates `x: [n, heads, head_dim]` row `i` by `positions[i]` with the RoPE
    /// of layer `layer` (negative positions rotate back; rotations compose, so
    /// this also moves roped keys by a position delta).
    pub fn rope(&self, layer: usize, x: &Tensor, positions: &[Pos]) -> Result<Tensor> {
        self.ropes[usize::from(self.config.is_global(layer))].apply(x, positions)
    }

    /// Bytes of matrices one decode step reads: every block's projections
    /// and the output head, in the type the weight mode holds them in (what
    /// bounds decode on a CPU: these bytes over the memory bandwidth).
    pub fn matrix_bytes(&self) -> usize {
        let blocks: usize = self
            .trunk
            .blocks
            .iter()
            .map(|b| b.qkv.bytes() + b.wo.bytes() + b.ffn.bytes())
            .sum();
        // Decode steps read the Q8_0 copy of the head where there is one.
        blocks
            + self
                .output_q8
                .as_ref()
                .map_or(self.output.bytes(), Q8Matrix::bytes)
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

    /// RMSNorm over the last dimension with weight `w + norm_offset`.
    fn norm(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
        let w = (w + self.config.norm_offset)?;
        Ok(x.broadcast_div(&(ms + self.config.rms_eps)?.sqrt()?)?
            .broadcast_mul(&w)?)
    }
}

/// Gemma 3: the engine's cache is a [`LayerGroupCache`] (window layers
/// keeping `window_memory` positions, global layers everything, each group
/// shifting keys with its own RoPE base), the trie's layers
/// [`GemmaLayer`]s.
impl LayerModel for Gemma {
    type Array = Tensor;
    type Layer = GemmaLayer;

    const RESUMABLE: bool = true;

    fn new_layers(&self) -> Result<Vec<GemmaLayer>> {
        Gemma::new_layers(self, &self.device)
    }

    fn hidden_layers(&self, tokens: &[u32], layers: &mut [GemmaLayer]) -> Result<Tensor> {
        Gemma::hidden_layers(self, tokens, layers)
    }

    fn next_token(&self, hidden: &Tensor) -> Result<u32> {
        let last = hidden.narrow(0, hidden.dim(0)? - 1, 1)?;
        let row = Gemma::logits(self, &last)?.squeeze(0)?.to_vec1::<f32>()?;
        Ok(crate::argmax(&row))
    }
}

impl Model for Gemma {
    type Cache = LayerGroupCache;

    fn architecture(&self) -> &'static str {
        "gemma3"
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn kv_layout(&self) -> KvLayout {
        let c = &self.config;
        KvLayout::new(c.n_layers, c.n_kv_heads, c.head_dim, DType::F32)
    }

    fn set_attention(&mut self, path: AttentionPath) {
        self.attention = path;
    }

    fn attention_path(&self) -> AttentionPath {
        self.attention
    }

    fn window(&self) -> Option<usize> {
        Some(self.config.window)
    }

    fn new_cache(
        &self,
        base: &CausalConfig,
        window_memory: usize,
        device: &Device,
    ) -> Result<LayerGroupCache> {
        Gemma::new_cache(self, base, window_memory, device)
    }

    fn hidden<C>(&self, batch: &[BatchToken], cache: &mut C) -> Result<Tensor>
    where
        C: CausalCache<Tensor = Tensor> + ?Sized,
    {
        Gemma::hidden(self, batch, cache)
    }

    fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        Gemma::logits(self, hidden)
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
