//! A Llama forward pass (RoPE, grouped-query attention, RMSNorm, SwiGLU) on candle,
//! with two paths: [`Llama::forward_full`] recomputes everything without any cache
//! (the reference), [`Llama::forward`] runs a batch of tokens of many sequences
//! through a [`CausalCache`].
//!
//! Shapes (row-major, outermost first): a batch of `n` tokens flows as hidden
//! states `[n, dim]`; queries `[n, n_heads, head_dim]`; keys and values
//! `[n, n_kv_heads, head_dim]` (what [`CausalCache::put`] takes); logits
//! `[n, vocab_size]`.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::{gguf_file, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor, D};
use kvcache_api::{Batch, CausalCache, ForwardMode, KeyShift, LayerCache, Pos, SeqId};

use crate::attention::{self, Attend, AttentionPath};
use crate::error::to_cache_err;
use crate::kernels::{self, Activation};
use crate::{ChatTokenizer, EngineError, LlamaConfig, Result};

/// How the weights are held in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightMode {
    /// Every weight dequantized to f32 (the default; fast on CPU, and what the
    /// equivalence tests use).
    #[default]
    F32,
    /// Matrices kept in their GGUF quantization and multiplied with candle's
    /// quantized kernels (smaller, but Q4_1 has no fast CPU kernel).
    Quantized,
}

/// One token of a batch: which sequence, at which position, which token id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchToken {
    /// The sequence the token belongs to.
    pub seq: SeqId,
    /// Its position inside the sequence.
    pub pos: Pos,
    /// Its token id.
    pub token: u32,
}

impl BatchToken {
    /// `tokens` of sequence `seq` at consecutive positions from `first`.
    pub fn run(seq: SeqId, first: Pos, tokens: &[u32]) -> Vec<BatchToken> {
        tokens
            .iter()
            .zip(first..)
            .map(|(&token, pos)| BatchToken { seq, pos, token })
            .collect()
    }
}

/// A weight matrix `[out, in]` applied as `x @ W^T` (dense: the transposed view
/// goes to the matmul as is; storing `W^T` contiguous measured no better).
#[derive(Debug, Clone)]
enum Linear {
    Dense(Tensor),
    Quant(QMatMul),
}

impl Linear {
    fn new(q: QTensor, mode: WeightMode, device: &Device) -> Result<Self> {
        Ok(match mode {
            WeightMode::F32 => Linear::dense(&q.dequantize(device)?)?,
            WeightMode::Quantized => Linear::Quant(QMatMul::from_qtensor(q)?),
        })
    }

    /// From `w: [out, in]`.
    fn dense(w: &Tensor) -> Result<Self> {
        Ok(Linear::Dense(w.clone()))
    }

    /// `x: [n, in]` to `[n, out]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Linear::Dense(w) => match skinny_forward(x, w)? {
                Some(y) => y,
                None => x.matmul(&w.t()?)?,
            },
            Linear::Quant(q) => q.forward(x)?,
        })
    }
}

/// `x @ w^T` through [`skinny::matmul_nt`] when `x` has few rows (decode steps),
/// both are f32 on the CPU and `w` is contiguous; `None` otherwise.
///
/// candle's CPU matmul hands `x @ w^T` to `gemm`, which computes it transposed
/// (`w @ x^T`) and, `w` being row-major, repacks the whole weight matrix on every
/// call: at 8 rows that costs more than the multiply. A single-row `x` takes
/// `gemm`'s matrix-vector path instead, so batching 8 decode tokens cost over 2x
/// one. `skinny` streams each weight row once for all rows of `x`.
fn skinny_forward(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    use candle_core::Storage;
    let (m, k) = x.dims2()?;
    let (n, kw) = w.dims2()?;
    if m == 0
        || m > skinny::MAX_ROWS
        || k != kw
        || !x.device().is_cpu()
        || x.dtype() != DType::F32
        || w.dtype() != DType::F32
        || !w.is_contiguous()
    {
        return Ok(None);
    }
    let x = x.contiguous()?;
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let (Storage::Cpu(xs), Storage::Cpu(ws)) = (&*xs, &*ws) else {
        return Ok(None);
    };
    let xv = &xs.as_slice::<f32>()?[xl.start_offset()..][..m * k];
    let wv = &ws.as_slice::<f32>()?[wl.start_offset()..][..n * k];
    let y = skinny::matmul_nt(xv, wv, m, n, k);
    Ok(Some(Tensor::from_vec(y, (m, n), x.device())?))
}

#[derive(Debug, Clone)]
struct Block {
    attn_norm: Tensor,
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    ffn_norm: Tensor,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// Progress of [`ModelFile::load`]: `done` of `total` tensors read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadProgress {
    /// Tensors read so far.
    pub done: usize,
    /// Tensors to read.
    pub total: usize,
}

/// A GGUF file whose header has been read: the model and its tokenizer come
/// from it.
#[derive(Debug)]
pub struct ModelFile {
    path: PathBuf,
    content: gguf_file::Content,
}

impl ModelFile {
    /// Reads the header (metadata and tensor directory) of the GGUF at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let mut file = File::open(&path).map_err(|e| EngineError::io(&path, e))?;
        let content = gguf_file::Content::read(&mut file)
            .map_err(|e| EngineError::Format(format!("{}: {e}", path.display())))?;
        Ok(ModelFile { path, content })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The model's hyper-parameters, from the header.
    pub fn config(&self) -> Result<LlamaConfig> {
        LlamaConfig::from_gguf_metadata(&self.content.metadata)
    }

    /// Number of tensors in the file.
    pub fn tensor_count(&self) -> usize {
        self.content.tensor_infos.len()
    }

    /// Reads every weight onto `device`; `progress` is called after each tensor.
    pub fn load(
        &self,
        device: &Device,
        mode: WeightMode,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Llama> {
        let mut file = File::open(&self.path).map_err(|e| EngineError::io(&self.path, e))?;
        Llama::from_gguf(&self.content, &mut file, device, mode, progress)
    }

    /// The tokenizer embedded in the header.
    pub fn tokenizer(&self) -> Result<ChatTokenizer> {
        ChatTokenizer::from_gguf_metadata(&self.content.metadata)
    }
}

/// RoPE in GGUF's interleaved layout (`candle_nn::rotary_emb::rope_i` semantics):
/// dimensions `(2i, 2i + 1)` of each head rotate together by `pos * base^(-2i / d)`.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Arc<[f64]>,
}

impl Rope {
    /// RoPE for heads of `head_dim` dimensions with frequency base `base`.
    pub fn new(head_dim: usize, base: f64) -> Self {
        let inv_freq = (0..head_dim / 2)
            .map(|i| 1.0 / base.powf(2.0 * i as f64 / head_dim as f64))
            .collect();
        Rope { inv_freq }
    }

    /// Rotates `x: [n, heads, head_dim]`, row `i` by `positions[i]` (any integer,
    /// negative ones rotate back). Returns the same shape.
    pub fn apply(&self, x: &Tensor, positions: &[Pos]) -> Result<Tensor> {
        let tables = self.tables(positions, x.device())?;
        self.apply_tables(x, &tables)
    }

    /// `cos` and `sin` of every (position, frequency) pair, `[n, 1, head_dim / 2, 1]`
    /// each, for [`apply_tables`](Self::apply_tables).
    pub fn tables(&self, positions: &[Pos], device: &Device) -> Result<(Tensor, Tensor)> {
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
            Tensor::from_vec(cos, (n, 1, half, 1), device)?,
            Tensor::from_vec(sin, (n, 1, half, 1), device)?,
        ))
    }

    /// Rotates `x: [n, heads, head_dim]` with tables from [`tables`](Self::tables).
    pub fn apply_tables(&self, x: &Tensor, (cos, sin): &(Tensor, Tensor)) -> Result<Tensor> {
        let (n, heads, head_dim) = x.dims3()?;
        let half = head_dim / 2;
        if half != self.inv_freq.len() || cos.dim(0)? != n {
            return Err(EngineError::InvalidArgument(format!(
                "rope: x {:?} with {} positions and head dim {}",
                x.dims(),
                cos.dim(0)?,
                2 * self.inv_freq.len()
            )));
        }
        let cos = cos.to_dtype(x.dtype())?;
        let sin = sin.to_dtype(x.dtype())?;
        let x = x.reshape((n, heads, half, 2))?;
        let x0 = x.narrow(3, 0, 1)?;
        let x1 = x.narrow(3, 1, 1)?;
        let o0 = (x0.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
        let o1 = (x0.broadcast_mul(&sin)? + x1.broadcast_mul(&cos)?)?;
        Ok(Tensor::cat(&[o0, o1], 3)?.reshape((n, heads, head_dim))?)
    }
}

/// Re-rotates cached keys after a shifting removal: `keys: [n, kv_heads, head_dim]`
/// rotated by `shifts[i]` positions (RoPE composes: `R(p) R(d) = R(p + d)`).
impl KeyShift<Tensor> for Rope {
    fn shift(&self, _layer: usize, keys: &Tensor, shifts: &[Pos]) -> kvcache_api::Result<Tensor> {
        self.apply(keys, shifts).map_err(|e| match e {
            EngineError::Candle(c) => to_cache_err(c),
            other => kvcache_api::CacheError::InvalidArgument(other.to_string()),
        })
    }
}

/// A Llama-architecture decoder with its weights.
#[derive(Debug, Clone)]
pub struct Llama {
    config: LlamaConfig,
    device: Device,
    /// `[vocab_size, dim]`, f32.
    embed: Tensor,
    blocks: Vec<Block>,
    /// `[dim]`.
    norm: Tensor,
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
        let total = content.tensor_infos.len();
        let mut done = 0;
        let mut get = |name: &str| -> Result<QTensor> {
            let t = content
                .tensor(reader, name, device)
                .map_err(|e| EngineError::Format(format!("tensor {name}: {e}")))?;
            done += 1;
            progress(LoadProgress { done, total });
            Ok(t)
        };
        let embed_q = get("token_embd.weight")?;
        let embed = embed_q.dequantize(device)?;
        let expect = |t: &Tensor, name: &str, dims: &[usize]| -> Result<()> {
            if t.dims() == dims {
                Ok(())
            } else {
                Err(EngineError::Format(format!(
                    "{name} has shape {:?}, expected {dims:?}",
                    t.dims()
                )))
            }
        };
        expect(&embed, "token_embd.weight", &[config.vocab_size, config.dim])?;
        let mut blocks = Vec::with_capacity(config.n_layers);
        for l in 0..config.n_layers {
            let mut lin = |name: &str, dims: [usize; 2]| -> Result<Linear> {
                let full = format!("blk.{l}.{name}.weight");
                let q = get(&full)?;
                if q.shape().dims() != dims {
                    return Err(EngineError::Format(format!(
                        "{full} has shape {:?}, expected {dims:?}",
                        q.shape().dims()
                    )));
                }
                Linear::new(q, mode, device)
            };
            let (dim, kv, ffn) = (config.dim, config.n_kv_heads * config.head_dim, config.ffn_dim);
            let wq = lin("attn_q", [config.n_heads * config.head_dim, dim])?;
            let wk = lin("attn_k", [kv, dim])?;
            let wv = lin("attn_v", [kv, dim])?;
            let wo = lin("attn_output", [dim, config.n_heads * config.head_dim])?;
            let gate = lin("ffn_gate", [ffn, dim])?;
            let up = lin("ffn_up", [ffn, dim])?;
            let down = lin("ffn_down", [dim, ffn])?;
            let attn_norm = get(&format!("blk.{l}.attn_norm.weight"))?.dequantize(device)?;
            let ffn_norm = get(&format!("blk.{l}.ffn_norm.weight"))?.dequantize(device)?;
            expect(&attn_norm, "attn_norm", &[dim])?;
            expect(&ffn_norm, "ffn_norm", &[dim])?;
            blocks.push(Block {
                attn_norm,
                wq,
                wk,
                wv,
                wo,
                ffn_norm,
                gate,
                up,
                down,
            });
        }
        let norm = get("output_norm.weight")?.dequantize(device)?;
        let output = if content.tensor_infos.contains_key("output.weight") {
            Linear::new(get("output.weight")?, mode, device)?
        } else {
            // Tied embeddings.
            match mode {
                WeightMode::F32 => Linear::dense(&embed)?,
                WeightMode::Quantized => Linear::Quant(QMatMul::from_qtensor(embed_q)?),
            }
        };
        let rope = Rope::new(config.head_dim, config.rope_base);
        Ok(Llama {
            config,
            device: device.clone(),
            embed,
            blocks,
            norm,
            output,
            rope,
            attention: AttentionPath::default(),
        })
    }

    /// A model with deterministic pseudo-random f32 weights (for tests): each
    /// matrix `[out, in]` uniform with variance `1 / in` (so logits are of order
    /// 1), norms near 1, a separate output projection.
    pub fn random(config: LlamaConfig, seed: u64, device: &Device) -> Result<Self> {
        config.validate()?;
        let mut rng = SplitMix64(seed);
        let mut mat = |rows: usize, cols: usize, scale: f32, offset: f32| -> Result<Tensor> {
            let data: Vec<f32> = (0..rows * cols)
                .map(|_| offset + scale * rng.next_sym())
                .collect();
            Ok(Tensor::from_vec(data, (rows, cols), device)?)
        };
        let a = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
        let (dim, ffn) = (config.dim, config.ffn_dim);
        let qd = config.n_heads * config.head_dim;
        let kv = config.n_kv_heads * config.head_dim;
        let embed = mat(config.vocab_size, dim, 1.0, 0.0)?;
        let mut blocks = Vec::new();
        for _ in 0..config.n_layers {
            blocks.push(Block {
                attn_norm: mat(1, dim, 0.2, 1.0)?.squeeze(0)?,
                // Larger query/key weights make attention weights far from uniform,
                // so a wrong mask or position shows in the logits.
                wq: Linear::dense(&mat(qd, dim, 2.0 * a(dim), 0.0)?)?,
                wk: Linear::dense(&mat(kv, dim, 2.0 * a(dim), 0.0)?)?,
                wv: Linear::dense(&mat(kv, dim, a(dim), 0.0)?)?,
                wo: Linear::dense(&mat(dim, qd, a(qd), 0.0)?)?,
                ffn_norm: mat(1, dim, 0.2, 1.0)?.squeeze(0)?,
                gate: Linear::dense(&mat(ffn, dim, a(dim), 0.0)?)?,
                up: Linear::dense(&mat(ffn, dim, a(dim), 0.0)?)?,
                down: Linear::dense(&mat(dim, ffn, a(ffn), 0.0)?)?,
            });
        }
        let norm = mat(1, dim, 0.2, 1.0)?.squeeze(0)?;
        let output = Linear::dense(&mat(config.vocab_size, dim, a(dim), 0.0)?)?;
        let rope = Rope::new(config.head_dim, config.rope_base);
        Ok(Llama {
            output,
            config,
            device: device.clone(),
            embed,
            blocks,
            norm,
            rope,
            attention: AttentionPath::default(),
        })
    }

    /// The same model with only its first `n_layers` blocks (at least 1). With
    /// one layer, keys and values depend on the token and its position alone, so
    /// a shifting removal is exactly a recomputation (see [`crate::check`]).
    pub fn truncated(&self, n_layers: usize) -> Self {
        let n = n_layers.clamp(1, self.blocks.len());
        let mut m = self.clone();
        m.blocks.truncate(n);
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

    /// The model's RoPE, usable as the cache's [`KeyShift`].
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
            return Err(EngineError::InvalidArgument("no tokens".into()));
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
            return Err(EngineError::InvalidArgument(format!(
                "{} layer caches for {} layers",
                caches.len(),
                c.n_layers
            )));
        }
        let n = tokens.len();
        let offset = caches[0].offset();
        if caches.iter().any(|l| l.offset() != offset) {
            return Err(EngineError::InvalidArgument(
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

    /// The shared layer loop. `attend(layer, q, keys, values)` receives this
    /// pass's roped queries `[n, n_heads, head_dim]`, keys and values `[n,
    /// kv_heads, head_dim]` and returns the attention's output `[n, n_heads *
    /// head_dim]`.
    fn run(
        &self,
        tokens: &[u32],
        positions: &[Pos],
        attend: &mut dyn FnMut(usize, &Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let c = &self.config;
        let n = tokens.len();
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(EngineError::InvalidArgument(format!(
                "token {t} outside the vocabulary of {}",
                c.vocab_size
            )));
        }
        let ids = Tensor::from_slice(tokens, n, &self.device)?;
        let mut x = self.embed.index_select(&ids, 0)?;
        let tables = self.rope.tables(positions, &self.device)?;
        for (l, block) in self.blocks.iter().enumerate() {
            let h = rms_norm(&x, &block.attn_norm, c.rms_eps)?;
            let q = block.wq.forward(&h)?.reshape((n, c.n_heads, c.head_dim))?;
            let k = block.wk.forward(&h)?.reshape((n, c.n_kv_heads, c.head_dim))?;
            let v = block.wv.forward(&h)?.reshape((n, c.n_kv_heads, c.head_dim))?;
            let q = self.rope.apply_tables(&q, &tables)?;
            let k = self.rope.apply_tables(&k, &tables)?;
            let attn = attend(l, &q, &k, &v.contiguous()?)?;
            x = (x + block.wo.forward(&attn)?)?;
            let h = rms_norm(&x, &block.ffn_norm, c.rms_eps)?;
            let (g, u) = (block.gate.forward(&h)?, block.up.forward(&h)?);
            let f = kernels::gated(&g, &u, Activation::Silu)?;
            x = (x + block.down.forward(&f)?)?;
        }
        rms_norm(&x, &self.norm, c.rms_eps)
    }
}

/// `x * w / sqrt(mean(x^2) + eps)` over the last dimension.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)?)
}

/// `y = x @ w^T` for a few rows of `x` (decode steps), streaming `w` from memory once.
///
/// At decode sizes the product is bound by reading the weights (all of them, 540 MB
/// in f32, once per forward pass), so the kernel reads each weight row from memory
/// once for all rows of `x` and prefetches the weights well ahead: with 8 rows it
/// then costs about what 1 row does. Single-threaded: on a shared 2-core machine a
/// second thread that waits on a busy core costs more than it brings.
mod skinny {
    /// The most rows of `x` worth this path (beyond, `gemm`'s packing pays off).
    pub(super) const MAX_ROWS: usize = 16;

    /// `y[i * n + j] = sum_q x[i * k + q] * w[j * k + q]`: `x` is `m x k`, `w` is
    /// `n x k`, both row-major; returns `y`, `m x n` row-major.
    pub(super) fn matmul_nt(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        assert!(x.len() == m * k && w.len() == n * k, "matmul_nt: bad lengths");
        let mut y = vec![0f32; m * n];
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above), which is
            // all `avx2::matmul_nt` requires.
            unsafe { avx2::matmul_nt(x, w, m, n, k, &mut y) };
            return y;
        }
        for (j, wj) in w.chunks_exact(k).enumerate() {
            for (i, xi) in x.chunks_exact(k).enumerate() {
                y[i * n + j] = dot(xi, wj);
            }
        }
        y
    }

    /// A portable dot product with eight independent partial sums.
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0f32; 8];
        let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
        let tail: f32 = ca
            .remainder()
            .iter()
            .zip(cb.remainder())
            .map(|(x, y)| x * y)
            .sum();
        for (x, y) in ca.zip(cb) {
            for l in 0..8 {
                acc[l] += x[l] * y[l];
            }
        }
        acc.iter().sum::<f32>() + tail
    }

    #[cfg(target_arch = "x86_64")]
    mod avx2 {
        use std::arch::x86_64::*;

        /// Rows of `x` per tile: 2 x `TILE` accumulators, `2 + TILE` loads per
        /// `2 * TILE` FMAs (AVX2 has 16 vector registers).
        const TILE: usize = 4;
        /// How far ahead of the current read weights are prefetched, in floats (8 KiB).
        const PREFETCH: usize = 2048;

        /// See [`super::matmul_nt`]: weight rows go two at a time (a last odd one
        /// pairs with itself), rows of `x` up to [`TILE`] at a time.
        ///
        /// # Safety
        /// The CPU must support AVX2 and FMA (`is_x86_feature_detected!`).
        /// Nothing else: every access goes through bounds-checked slices, so
        /// lengths that disagree with `m`, `n` and `k` panic.
        #[target_feature(enable = "avx2,fma")]
        pub(super) unsafe fn matmul_nt(x: &[f32], w: &[f32], m: usize, n: usize, k: usize, y: &mut [f32]) {
            let mut j = 0;
            while j < n {
                let pair = (n - j).min(2);
                let w0 = &w[j * k..(j + 1) * k];
                let w1 = &w[(j + pair - 1) * k..(j + pair) * k];
                let mut i = 0;
                while i < m {
                    let t = (m - i).min(TILE);
                    let xs = &x[i * k..(i + t) * k];
                    // SAFETY: this function's contract: the CPU supports AVX2 and
                    // FMA, which is all `tile` requires (it checks the lengths).
                    let s = unsafe {
                        match t {
                            4 => tile::<4>(xs, w0, w1, k),
                            3 => tile::<3>(xs, w0, w1, k),
                            2 => tile::<2>(xs, w0, w1, k),
                            _ => tile::<1>(xs, w0, w1, k),
                        }
                    };
                    for r in 0..t {
                        y[(i + r) * n + j] = s[0][r];
                        if pair == 2 {
                            y[(i + r) * n + j + 1] = s[1][r];
                        }
                    }
                    i += t;
                }
                j += pair;
            }
        }

        /// `[c][r] = x_r . w_c` for the `T <= TILE` rows of `x` (`T x k`).
        ///
        /// # Safety
        /// The CPU must support AVX2 and FMA. The lengths are checked (`T <=
        /// TILE`, `x` at least `T * k` floats, `w0` and `w1` at least `k`): a
        /// short slice panics before any load.
        #[target_feature(enable = "avx2,fma")]
        unsafe fn tile<const T: usize>(x: &[f32], w0: &[f32], w1: &[f32], k: usize) -> [[f32; TILE]; 2] {
            assert!(T <= TILE && x.len() >= T * k && w0.len() >= k && w1.len() >= k);
            let k8 = k / 8 * 8;
            let mut s = [[0f32; TILE]; 2];
            // SAFETY: the CPU supports AVX2 and FMA (this function's contract), as
            // the intrinsics and `hsum` require. Every load reads 8 floats at
            // `q + 8 <= k8 <= k` of a row of `k` floats: row `r < T` of `x`
            // (`x.len() >= T * k`), or `w0`/`w1` (`len >= k`), all asserted above.
            // Prefetches never fault, and `wrapping_add` makes no in-bounds
            // promise, so running past the end is harmless.
            unsafe {
                let mut a0 = [_mm256_setzero_ps(); T];
                let mut a1 = [_mm256_setzero_ps(); T];
                let mut q = 0;
                while q < k8 {
                    _mm_prefetch::<_MM_HINT_T0>(w0.as_ptr().wrapping_add(q + PREFETCH).cast());
                    _mm_prefetch::<_MM_HINT_T0>(w1.as_ptr().wrapping_add(q + PREFETCH).cast());
                    let b0 = _mm256_loadu_ps(w0.as_ptr().add(q));
                    let b1 = _mm256_loadu_ps(w1.as_ptr().add(q));
                    for r in 0..T {
                        let a = _mm256_loadu_ps(x.as_ptr().add(r * k + q));
                        a0[r] = _mm256_fmadd_ps(a, b0, a0[r]);
                        a1[r] = _mm256_fmadd_ps(a, b1, a1[r]);
                    }
                    q += 8;
                }
                for r in 0..T {
                    s[0][r] = hsum(a0[r]);
                    s[1][r] = hsum(a1[r]);
                }
            }
            for r in 0..T {
                for q in k8..k {
                    s[0][r] += x[r * k + q] * w0[q];
                    s[1][r] += x[r * k + q] * w1[q];
                }
            }
            s
        }

        /// Sum of the 8 lanes.
        ///
        /// # Safety
        /// The CPU must support AVX2 and FMA (the features this function is
        /// compiled with; its intrinsics need only AVX).
        #[target_feature(enable = "avx2,fma")]
        unsafe fn hsum(v: __m256) -> f32 {
            // These intrinsics need only AVX, which this function is compiled
            // with: calling them here is safe (Rust 1.86, below the MSRV).
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
        }
    }
}

/// A small deterministic generator for test weights.
pub(crate) struct SplitMix64(pub(crate) u64);

impl SplitMix64 {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    pub(crate) fn next_sym(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

#[cfg(test)]
mod tests {
    use super::skinny::matmul_nt;

    #[test]
    fn skinny_matmul_matches_a_plain_product() {
        let mut rng = super::SplitMix64(7);
        for &(m, n, k) in &[
            (1, 1, 1),
            (1, 5, 17),
            (3, 7, 33),
            (8, 64, 576),
            (9, 3, 40),
            (16, 31, 100),
            (5, 2, 8),
        ] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.next_sym()).collect();
            let w: Vec<f32> = (0..n * k).map(|_| rng.next_sym()).collect();
            let y = matmul_nt(&x, &w, m, n, k);
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|q| f64::from(x[i * k + q]) * f64::from(w[j * k + q]))
                        .sum();
                    let got = f64::from(y[i * n + j]);
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "m {m} n {n} k {k} ({i}, {j}): {got} vs {want}"
                    );
                }
            }
        }
    }
}
