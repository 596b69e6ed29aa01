//! A Llama forward pass (RoPE, grouped-query attention, RMSNorm, SwiGLU) on candle,
//! with two paths: [`Llama::forward_full`] recomputes everything without any cache
//! (the reference), [`Llama::forward`] runs a batch of tokens of many sequences
//! through a [`CausalCache`].
//!
//! Shapes (row-major, outermost first): a batch of `n` tokens flows as hidden
//! states `[n, dim]`; queries `[n, n_heads, head_dim]`; keys and values
//! `[n, n_kv_heads, head_dim]` (what [`CausalCache::put`] takes); logits
//! `[n, vocab_size]`.

use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor, D};
use kvcache_api::{Batch, CausalCache, CausalConfig, ForwardMode, KvLayout, LayerCache, Pos};
use kvcache_causal::layer_cache::CandleKv;
use kvcache_causal::{CausalKvCache, RopeLayout, RopeShift};

use crate::attention::{self, Attend, AttentionPath};
use crate::decoder::{AttendFn, FeedForward, Qkv, Trunk};
use crate::gguf::{GgufFile, Tensors};
use crate::kernels::Activation;
use crate::model::{BatchToken, LayerModel, Model};
use crate::weights::{DenseKernel, Draw, GgufWeights, Linear, RandomWeights, WeightSource, WeightSpec};
use crate::{ChatTokenizer, LlamaConfig, LoadProgress, ModelError, Result, Rope, WeightMode};

/// The Llama's dense products: few rows (decode steps) through the streaming
/// kernel (through `gemm`, 8 decode rows cost over 2x one; see
/// `weights/skinny.rs`).
const KERNEL: DenseKernel = DenseKernel::FewRows;

#[derive(Debug, Clone)]
struct Block {
    attn_norm: Tensor,
    qkv: Qkv,
    wo: Linear,
    ffn_norm: Tensor,
    ffn: FeedForward,
}

impl Block {
    /// Block `layer`'s weights from `source`.
    fn new(c: &LlamaConfig, layer: usize, source: &mut dyn WeightSource) -> Result<Self> {
        let [attn_norm, wq, wk, wv, wo, ffn_norm, gate, up, down] = block_weights(c, layer);
        Ok(Block {
            attn_norm: source.tensor(&attn_norm)?,
            qkv: Qkv::new(source, [&wq, &wk, &wv])?,
            wo: source.linear(&wo)?,
            ffn_norm: source.tensor(&ffn_norm)?,
            ffn: FeedForward::new(source, [&gate, &up, &down])?,
        })
    }
}

/// Block `layer`'s weights, in the order [`Llama::random`] draws them: each
/// matrix `[out, in]` uniform with variance `1 / in`, queries and keys wider
/// (peaked attention, so a wrong mask or position shows in the logits), norm
/// weights near 1. (The mlx model's weights follow the same specs.)
pub(crate) fn block_weights(c: &LlamaConfig, layer: usize) -> [WeightSpec; 9] {
    let (dim, qd, kv, ffn) = (
        c.dim,
        c.n_heads * c.head_dim,
        c.n_kv_heads * c.head_dim,
        c.ffn_dim,
    );
    let w = |name: &str, shape: Vec<usize>, draw: Draw| WeightSpec::block(layer, name, shape, draw);
    [
        w("attn_norm", vec![dim], Draw::NORM),
        w("attn_q", vec![qd, dim], Draw::matrix(dim).times(2.0)),
        w("attn_k", vec![kv, dim], Draw::matrix(dim).times(2.0)),
        w("attn_v", vec![kv, dim], Draw::matrix(dim)),
        w("attn_output", vec![dim, qd], Draw::matrix(qd)),
        w("ffn_norm", vec![dim], Draw::NORM),
        w("ffn_gate", vec![ffn, dim], Draw::matrix(dim)),
        w("ffn_up", vec![ffn, dim], Draw::matrix(dim)),
        w("ffn_down", vec![dim, ffn], Draw::matrix(ffn)),
    ]
}

/// The weights around the blocks, by role: the token embedding (`[vocab, dim]`,
/// drawn in `[-1, 1)`), the final norm, and the output projection (absent from
/// files whose output is tied to the embedding).
pub(crate) fn outer_weights(c: &LlamaConfig) -> [WeightSpec; 3] {
    let [embed, norm] = WeightSpec::trunk(c.vocab_size, c.dim, Draw::new(1.0, 0.0));
    let output = WeightSpec::new("output.weight", vec![c.vocab_size, c.dim], Draw::matrix(c.dim));
    [embed, norm, output]
}

/// A GGUF file whose header has been read (any architecture: see
/// [`architecture`](Self::architecture)); the Llama and its tokenizer come
/// from it.
#[derive(Debug)]
pub struct ModelFile {
    gguf: GgufFile,
}

impl ModelFile {
    /// Reads the header (metadata and tensor directory) of the GGUF at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        GgufFile::open(path).map(ModelFile::from)
    }

    /// The header, whatever the architecture.
    pub fn gguf(&self) -> &GgufFile {
        &self.gguf
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        self.gguf.path()
    }

    /// The architecture the header names (`general.architecture`: `llama`,
    /// `gemma3`, ...), `None` when it names none.
    pub fn architecture(&self) -> Option<&str> {
        self.gguf.architecture()
    }

    /// The model's hyper-parameters, from the header.
    pub fn config(&self) -> Result<LlamaConfig> {
        LlamaConfig::from_gguf_metadata(self.gguf.metadata())
    }

    /// Number of tensors in the file.
    pub fn tensor_count(&self) -> usize {
        self.gguf.tensor_count()
    }

    /// Reads every weight onto `device`; `progress` is called after each tensor.
    pub fn load(
        &self,
        device: &Device,
        mode: WeightMode,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Llama> {
        self.gguf
            .build(|content, file| Llama::from_gguf(content, file, device, mode, progress))
    }

    /// The tokenizer embedded in the header.
    pub fn tokenizer(&self) -> Result<ChatTokenizer> {
        ChatTokenizer::from_gguf_metadata(self.gguf.metadata())
    }
}

/// A header already read, whatever it names (checked when the model is read).
impl From<GgufFile> for ModelFile {
    fn from(gguf: GgufFile) -> Self {
        ModelFile { gguf }
    }
}

/// A Llama-architecture decoder with its weights.
#[derive(Debug, Clone)]
pub struct Llama {
    config: LlamaConfig,
    device: Device,
    trunk: Trunk<Block>,
    output: Linear,
    rope: Rope,
    /// How [`hidden`](Llama::hidden) attends through a causal cache.
    attention: AttentionPath,
}

impl Llama {
    /// Builds the model from an already parsed GGUF header and its file.
    pub fn from_gguf<R: std::io::Read + std::io::Seek>(
        content: &gguf_file::Content,
        reader: &mut R,
        device: &Device,
        mode: WeightMode,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Self> {
        let config = LlamaConfig::from_gguf_metadata(&content.metadata)?;
        mode.check_device(device)?;
        let tensors = Tensors::new(content, reader, device, progress);
        let mut source = GgufWeights::new(tensors, mode, KERNEL, device);
        let [embed, norm, output] = outer_weights(&config);
        let block = |l, source: &mut dyn WeightSource| Block::new(&config, l, source);
        let (trunk, stored) = Trunk::new(&mut source, (&embed, &norm), config.n_layers, block)?;
        let output = if source.contains(&output.name) {
            source.linear(&output)?
        } else {
            Linear::tied(&trunk.embed, stored, mode, KERNEL)?
        };
        Ok(Llama::with_weights(config, device, trunk, output))
    }

    /// A model with deterministic pseudo-random f32 weights (for tests): each
    /// matrix `[out, in]` uniform with variance `1 / in` (so logits are of order
    /// 1), queries and keys wider, norms near 1, a separate output projection.
    pub fn random(config: LlamaConfig, seed: u64, device: &Device) -> Result<Self> {
        Llama::random_in(config, seed, WeightMode::F32, device)
    }

    /// [`random`](Llama::random) with the matrices held as `mode` says
    /// (drawn in f32, then converted: the same numbers in every mode, up to
    /// the mode's rounding).
    pub fn random_in(config: LlamaConfig, seed: u64, mode: WeightMode, device: &Device) -> Result<Self> {
        config.validate()?;
        mode.check_device(device)?;
        let mut source = RandomWeights::new(seed, mode, KERNEL, device);
        let [embed, norm, output] = outer_weights(&config);
        let block = |l, source: &mut dyn WeightSource| Block::new(&config, l, source);
        let (trunk, _) = Trunk::new(&mut source, (&embed, &norm), config.n_layers, block)?;
        let output = source.linear(&output)?;
        Ok(Llama::with_weights(config, device, trunk, output))
    }

    fn with_weights(config: LlamaConfig, device: &Device, trunk: Trunk<Block>, output: Linear) -> Self {
        Llama {
            rope: Rope::new(config.head_dim, config.rope_base),
            config,
            device: device.clone(),
            trunk,
            output,
            attention: AttentionPath::default(),
        }
    }

    /// The same model with only its first `n_layers` blocks (at least 1). With
    /// one layer, keys and values depend on the token and its position alone, so
    /// a shifting removal is exactly a recomputation (what the equivalence tests'
    /// checker, `tests/common/check.rs`, relies on).
    pub fn truncated(&self, n_layers: usize) -> Self {
        let n = n_layers.clamp(1, self.trunk.blocks.len());
        let mut m = self.clone();
        m.trunk.blocks.truncate(n);
        m.config.n_layers = n;
        m
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
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
        blocks + self.output.bytes()
    }

    /// The model's RoPE, usable as the cache's [`KeyShift`](kvcache_api::KeyShift).
    pub fn rope(&self) -> &Rope {
        &self.rope
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

    /// The attention's score scale, `1 / sqrt(head_dim)`.
    fn scale(&self) -> f32 {
        (1.0 / (self.config.head_dim as f64).sqrt()) as f32
    }

    /// Logits `[n, vocab_size]` for `tokens` as one sequence at positions
    /// `0..n`, recomputing everything without a cache. With `window = Some(w)` a
    /// token at `p` attends to positions `p - w + 1 ..= p` only.
    pub fn forward_full(&self, tokens: &[u32], window: Option<usize>) -> Result<Tensor> {
        let hidden = self.hidden_full(tokens, window)?;
        self.logits(&hidden)
    }

    /// Final normed hidden states `[n, dim]` of [`forward_full`](Self::forward_full).
    pub fn hidden_full(&self, tokens: &[u32], window: Option<usize>) -> Result<Tensor> {
        let n = tokens.len();
        if n == 0 {
            return Err(ModelError::InvalidArgument("no tokens".into()));
        }
        let positions: Vec<Pos> = (0..n as Pos).collect();
        let mut mask = vec![0f32; n * n];
        for i in 0..n {
            for j in 0..n {
                let visible = j <= i && window.is_none_or(|w| i - j < w);
                if !visible {
                    mask[i * n + j] = f32::NEG_INFINITY;
                }
            }
        }
        let mask = Tensor::from_vec(mask, (n, n), &self.device)?;
        let scale = self.scale();
        self.run(tokens, &positions, &mut |_, q, k, v| {
            let ctx = Attend {
                keys: k.clone(),
                values: v.clone(),
                mask: mask.clone(),
                permuted: false,
            };
            attention::dense_attention(q, &ctx, scale)
        })
    }

    /// Logits `[n, vocab_size]` for a batch of tokens of any sequences, through
    /// `cache`: one `start_forward`, then per layer `set_layer`, `put` and
    /// `get_paged` (or `get`: see [`set_attention`](Self::set_attention)).
    pub fn forward<C>(&self, batch: &[BatchToken], cache: &mut C) -> Result<Tensor>
    where
        C: CausalCache<Tensor = Tensor> + ?Sized,
    {
        let hidden = self.hidden(batch, cache)?;
        self.logits(&hidden)
    }

    /// Final normed hidden states `[n, dim]` of [`forward`](Self::forward); turn
    /// the rows you need into logits with [`logits`](Self::logits).
    pub fn hidden<C>(&self, batch: &[BatchToken], cache: &mut C) -> Result<Tensor>
    where
        C: CausalCache<Tensor = Tensor> + ?Sized,
    {
        let b = Batch::from_tokens(batch.iter().map(|t| (t.seq, t.pos)))?;
        cache.start_forward(&b, ForwardMode::Compute)?;
        let tokens: Vec<u32> = batch.iter().map(|t| t.token).collect();
        let (path, scale) = (self.attention, self.scale());
        self.run(&tokens, b.positions(), &mut |layer, q, k, v| {
            attention::cached_attention(cache, path, layer, q, k, v, scale)
        })
    }

    /// Final normed hidden states `[n, dim]` for `tokens` appended to one live
    /// sequence held in per-layer caches (`caches[l]` for layer `l`, e.g. the
    /// ones a `kvcache_trie::PrefixCache` session hands out). The tokens
    /// take positions `offset..offset + n`, `offset` being what the caches hold.
    pub fn hidden_layers<L>(&self, tokens: &[u32], caches: &mut [L]) -> Result<Tensor>
    where
        L: LayerCache<Array = Tensor>,
    {
        let c = &self.config;
        if caches.len() != c.n_layers {
            return Err(ModelError::InvalidArgument(format!(
                "{} layer caches for {} layers",
                caches.len(),
                c.n_layers
            )));
        }
        let n = tokens.len();
        let offset = caches[0].offset();
        if caches.iter().any(|l| l.offset() != offset) {
            return Err(ModelError::InvalidArgument(
                "layer caches hold different offsets".into(),
            ));
        }
        let positions: Vec<Pos> = (offset..offset + n).map(|p| p as Pos).collect();
        let total = offset + n;
        let mut mask = vec![0f32; n * total];
        for i in 0..n {
            mask[i * total + offset + i + 1..(i + 1) * total].fill(f32::NEG_INFINITY);
        }
        let mask = Tensor::from_vec(mask, (n, total), &self.device)?;
        let scale = self.scale();
        self.run(tokens, &positions, &mut |layer, q, k, v| {
            // [n, kv_heads, head_dim] -> [1, kv_heads, n, head_dim]
            let k = k.transpose(0, 1)?.unsqueeze(0)?.contiguous()?;
            let v = v.transpose(0, 1)?.unsqueeze(0)?.contiguous()?;
            let (keys, values) = caches[layer].update(&k, &v)?;
            // [1, kv_heads, total, head_dim] -> [total, kv_heads, head_dim]
            let ctx = Attend {
                keys: keys.squeeze(0)?.transpose(0, 1)?,
                values: values.squeeze(0)?.transpose(0, 1)?,
                mask: mask.clone(),
                permuted: false,
            };
            attention::dense_attention(q, &ctx, scale)
        })
    }

    /// Logits `[n, vocab_size]` from final hidden states `[n, dim]`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.output.forward(hidden)
    }

    /// The shared layer loop, each layer's attention by `attend` (see
    /// [`AttendFn`]). Returns the final normed hidden states `[n, dim]`.
    fn run(&self, tokens: &[u32], positions: &[Pos], attend: &mut AttendFn<'_>) -> Result<Tensor> {
        let c = &self.config;
        let mut x = self.trunk.embed(tokens)?;
        let tables = self.rope.tables(positions, &self.device)?;
        for (l, block) in self.trunk.blocks.iter().enumerate() {
            let h = rms_norm(&x, &block.attn_norm, c.rms_eps)?;
            let (q, k, v) = block.qkv.forward(&h, (c.n_heads, c.n_kv_heads, c.head_dim))?;
            let q = self.rope.apply_tables(&q, &tables)?;
            let k = self.rope.apply_tables(&k, &tables)?;
            let attn = attend(l, &q, &k, &v.contiguous()?)?;
            x = (x + block.wo.forward(&attn)?)?;
            let h = rms_norm(&x, &block.ffn_norm, c.rms_eps)?;
            x = (x + block.ffn.forward(&h, Activation::Silu)?)?;
        }
        rms_norm(&x, &self.trunk.norm, c.rms_eps)
    }
}

/// `x * w / sqrt(mean(x^2) + eps)` over the last dimension.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)?)
}

/// SmolLM2 and other Llama-architecture models: every layer sees every
/// position, so the engine's cache is one [`CausalKvCache`] whose keys shift
/// with the interleaved RoPE, and the trie's layers are [`CandleKv`]s.
impl LayerModel for Llama {
    type Array = Tensor;
    type Layer = CandleKv;

    const RESUMABLE: bool = false;

    fn new_layers(&self) -> Result<Vec<CandleKv>> {
        let c = &self.config;
        Ok((0..c.n_layers)
            .map(|_| CandleKv::new(c.n_kv_heads, c.head_dim, &self.device))
            .collect())
    }

    fn hidden_layers(&self, tokens: &[u32], layers: &mut [CandleKv]) -> Result<Tensor> {
        Llama::hidden_layers(self, tokens, layers)
    }

    fn next_token(&self, hidden: &Tensor) -> Result<u32> {
        let last = hidden.narrow(0, hidden.dim(0)? - 1, 1)?;
        let row = Llama::logits(self, &last)?.squeeze(0)?.to_vec1::<f32>()?;
        Ok(crate::argmax(&row))
    }
}

impl Model for Llama {
    type Cache = CausalKvCache;

    fn architecture(&self) -> &'static str {
        "llama"
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn kv_layout(&self) -> KvLayout {
        let c = &self.config;
        KvLayout::new(c.n_layers, c.n_kv_heads, c.head_dim, kvcache_api::DType::F32)
    }

    fn set_attention(&mut self, path: AttentionPath) {
        self.attention = path;
    }

    fn attention_path(&self) -> AttentionPath {
        self.attention
    }

    fn new_cache(
        &self,
        base: &CausalConfig,
        _window_memory: usize,
        device: &Device,
    ) -> Result<CausalKvCache> {
        let c = &self.config;
        let shift = RopeShift::new(RopeLayout::Normal, c.head_dim, c.rope_base as f32)?;
        Ok(CausalKvCache::new(
            base.clone(),
            device.clone(),
            Some(Box::new(shift)),
        )?)
    }

    fn hidden<C>(&self, batch: &[BatchToken], cache: &mut C) -> Result<Tensor>
    where
        C: CausalCache<Tensor = Tensor> + ?Sized,
    {
        Llama::hidden(self, batch, cache)
    }

    fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        Llama::logits(self, hidden)
    }
}
