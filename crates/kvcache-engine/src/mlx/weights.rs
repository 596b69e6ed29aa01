//! [`HostWeights`]: a Llama's weights as f32 host data, named as in GGUF files.
//!
//! Read with candle's GGUF reader and dequantization (the path
//! [`crate::ModelFile::load`] takes in [`crate::WeightMode::F32`]), so the mlx
//! model multiplies exactly the numbers the candle model does.

use std::collections::HashMap;
use std::fs::File;

use candle_core::quantized::gguf_file;
use candle_core::Device;

use crate::{EngineError, LlamaConfig, LoadProgress, ModelFile, Result};

/// One weight: its shape (outermost first, `[out, in]` for matrices) and its
/// values in row-major order.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// `shape.iter().product()` values, row-major.
    pub data: Vec<f32>,
}

/// Every weight of a Llama, by GGUF name: `token_embd.weight` `[vocab, dim]`,
/// per block `l` `blk.{l}.attn_norm.weight` `[dim]`, `blk.{l}.attn_q.weight`
/// `[heads * head_dim, dim]`, `attn_k`/`attn_v` `[kv_heads * head_dim, dim]`,
/// `attn_output` `[dim, heads * head_dim]`, `ffn_norm` `[dim]`,
/// `ffn_gate`/`ffn_up` `[ffn, dim]`, `ffn_down` `[dim, ffn]`, then
/// `output_norm.weight` `[dim]` and, unless the embedding is tied,
/// `output.weight` `[vocab, dim]`.
#[derive(Debug, Clone)]
pub struct HostWeights {
    config: LlamaConfig,
    tensors: HashMap<String, HostTensor>,
}

/// The per-block weight names (`blk.{l}.{name}.weight`) with their shapes.
pub(crate) fn block_shapes(c: &LlamaConfig) -> [(&'static str, Vec<usize>); 9] {
    let (dim, q, kv, ffn) = (
        c.dim,
        c.n_heads * c.head_dim,
        c.n_kv_heads * c.head_dim,
        c.ffn_dim,
    );
    [
        ("attn_norm", vec![dim]),
        ("attn_q", vec![q, dim]),
        ("attn_k", vec![kv, dim]),
        ("attn_v", vec![kv, dim]),
        ("attn_output", vec![dim, q]),
        ("ffn_norm", vec![dim]),
        ("ffn_gate", vec![ffn, dim]),
        ("ffn_up", vec![ffn, dim]),
        ("ffn_down", vec![dim, ffn]),
    ]
}

impl HostWeights {
    /// Reads and dequantizes every weight of `file` (whose header says it is a
    /// Llama); `progress` is called after each tensor.
    pub fn load(file: &ModelFile, progress: &mut dyn FnMut(LoadProgress)) -> Result<Self> {
        let config = file.config()?;
        let path = file.path();
        let mut reader = File::open(path).map_err(|e| EngineError::io(path, e))?;
        let content = gguf_file::Content::read(&mut reader)
            .map_err(|e| EngineError::Format(format!("{}: {e}", path.display())))?;
        let total = content.tensor_infos.len();
        let mut tensors = HashMap::with_capacity(total);
        // The file's order, so reads go forward through it.
        let mut names: Vec<(&String, u64)> = content
            .tensor_infos
            .iter()
            .map(|(name, info)| (name, info.offset))
            .collect();
        names.sort_by_key(|&(_, offset)| offset);
        for (done, (name, _)) in names.into_iter().enumerate() {
            let t = content
                .tensor(&mut reader, name, &Device::Cpu)
                .and_then(|q| q.dequantize(&Device::Cpu))
                .map_err(|e| EngineError::Format(format!("tensor {name}: {e}")))?;
            let shape = t.dims().to_vec();
            let data = t.flatten_all()?.to_vec1::<f32>()?;
            tensors.insert(name.clone(), HostTensor { shape, data });
            progress(LoadProgress {
                done: done + 1,
                total,
            });
        }
        let weights = HostWeights { config, tensors };
        weights.validate()?;
        Ok(weights)
    }

    /// Deterministic pseudo-random weights for tests, distributed like
    /// [`crate::Llama::random`]'s (each matrix `[out, in]` uniform with variance
    /// `1 / in`, larger query/key weights, norms near 1, a separate output
    /// projection), though not the same numbers.
    pub fn random(config: LlamaConfig, seed: u64) -> Result<Self> {
        config.validate()?;
        let mut state = seed;
        let mut next = move || {
            // SplitMix64, mapped to [-1, 1).
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        };
        let mut tensors = HashMap::new();
        let mut add = |name: String, shape: Vec<usize>, scale: f32, offset: f32| {
            let data = (0..shape.iter().product::<usize>())
                .map(|_| offset + scale * next())
                .collect();
            tensors.insert(name, HostTensor { shape, data });
        };
        let a = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
        add(
            "token_embd.weight".into(),
            vec![config.vocab_size, config.dim],
            1.0,
            0.0,
        );
        for l in 0..config.n_layers {
            for (name, shape) in block_shapes(&config) {
                let (scale, offset) = match name {
                    "attn_norm" | "ffn_norm" => (0.2, 1.0),
                    // Peaked attention, so a wrong mask or position shows.
                    "attn_q" | "attn_k" => (2.0 * a(shape[1]), 0.0),
                    _ => (a(shape[1]), 0.0),
                };
                add(format!("blk.{l}.{name}.weight"), shape, scale, offset);
            }
        }
        add("output_norm.weight".into(), vec![config.dim], 0.2, 1.0);
        add(
            "output.weight".into(),
            vec![config.vocab_size, config.dim],
            a(config.dim),
            0.0,
        );
        Ok(HostWeights { config, tensors })
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The weight called `name`, if present.
    pub fn get(&self, name: &str) -> Option<&HostTensor> {
        self.tensors.get(name)
    }

    /// The weight called `name`, checked to have `shape`.
    pub(crate) fn expect(&self, name: &str, shape: &[usize]) -> Result<&HostTensor> {
        let t = self
            .get(name)
            .ok_or_else(|| EngineError::Format(format!("missing tensor {name}")))?;
        if t.shape != shape {
            return Err(EngineError::Format(format!(
                "{name} has shape {:?}, expected {shape:?}",
                t.shape
            )));
        }
        Ok(t)
    }

    /// Every weight, sorted by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &HostTensor)> {
        let mut all: Vec<_> = self.tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        all.sort_by_key(|&(k, _)| k);
        all.into_iter()
    }

    /// Checks that every weight the config calls for is present with its shape.
    fn validate(&self) -> Result<()> {
        let c = &self.config;
        self.expect("token_embd.weight", &[c.vocab_size, c.dim])?;
        for l in 0..c.n_layers {
            for (name, shape) in block_shapes(c) {
                self.expect(&format!("blk.{l}.{name}.weight"), &shape)?;
            }
        }
        self.expect("output_norm.weight", &[c.dim])?;
        if self.get("output.weight").is_some() {
            self.expect("output.weight", &[c.vocab_size, c.dim])?;
        }
        Ok(())
    }
}
