//! [`HostWeights`]: a Llama's weights as f32 host data, named as in GGUF files.
//!
//! Read with candle's GGUF reader and dequantization (the path
//! [`crate::ModelFile::load`] takes in [`crate::WeightMode::F32`]), so the mlx
//! model multiplies exactly the numbers the candle model does.

use std::collections::HashMap;

use candle_core::quantized::QTensor;
use candle_core::Device;

use crate::gguf::{check_shape, Tensors};
use crate::llama::{block_weights, outer_weights};
use crate::weights::SplitMix64;
use crate::weights::WeightSpec;
use crate::{LlamaConfig, LoadProgress, ModelError, ModelFile, Result};

/// One weight: its shape (outermost first, `[out, in]` for matrices) and its
/// values in row-major order.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// `shape.iter().product()` values, row-major.
    pub data: Vec<f32>,
}

impl HostTensor {
    /// A GGUF tensor dequantized to f32 (candle's dequantization: the numbers
    /// the candle model multiplies in [`crate::WeightMode::F32`]).
    pub(crate) fn from_qtensor(q: &QTensor) -> Result<Self> {
        let t = q.dequantize(&Device::Cpu)?;
        Ok(HostTensor {
            shape: t.dims().to_vec(),
            data: t.flatten_all()?.to_vec1::<f32>()?,
        })
    }
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

/// Every weight of a Llama of `config` in the order random weights are drawn:
/// the embedding, each block's, the final norm, then the output projection
/// (absent from files whose output is tied to the embedding).
fn all_weights(config: &LlamaConfig) -> impl Iterator<Item = WeightSpec> + '_ {
    let [embed, norm, output] = outer_weights(config);
    let blocks = (0..config.n_layers).flat_map(|l| block_weights(config, l));
    std::iter::once(embed).chain(blocks).chain([norm, output])
}

impl HostWeights {
    /// Reads and dequantizes every weight of `file` (whose header says it is a
    /// Llama); `progress` is called after each tensor.
    pub fn load(file: &ModelFile, progress: &mut dyn FnMut(LoadProgress)) -> Result<Self> {
        let config = file.config()?;
        let tensors = file.gguf().build(|content, reader| {
            // The file's order, so reads go forward through it.
            let mut names: Vec<(&String, u64)> = content
                .tensor_infos
                .iter()
                .map(|(name, info)| (name, info.offset))
                .collect();
            names.sort_by_key(|&(_, offset)| offset);
            let mut tensors = Tensors::new(content, reader, &Device::Cpu, progress);
            names
                .into_iter()
                .map(|(name, _)| Ok((name.clone(), HostTensor::from_qtensor(&tensors.read_any(name)?)?)))
                .collect::<Result<HashMap<_, _>>>()
        })?;
        let weights = HostWeights { config, tensors };
        weights.validate()?;
        Ok(weights)
    }

    /// Deterministic pseudo-random weights for tests: the numbers of
    /// [`crate::Llama::random`] with the same `config` and `seed` (each matrix
    /// `[out, in]` uniform with variance `1 / in`, larger query/key weights,
    /// norms near 1, a separate output projection), drawn from the same specs.
    pub fn random(config: LlamaConfig, seed: u64) -> Result<Self> {
        config.validate()?;
        let mut rng = SplitMix64(seed);
        let tensors = all_weights(&config)
            .map(|w| {
                let data = w.draw.values(&mut rng, w.len());
                (w.name, HostTensor { shape: w.shape, data })
            })
            .collect();
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
            .ok_or_else(|| ModelError::Format(format!("missing tensor {name}")))?;
        check_shape(name, &t.shape, shape)?;
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
        let [.., output] = outer_weights(&self.config);
        for w in all_weights(&self.config) {
            // Files whose output is tied to the embedding have no output projection.
            if w != output || self.get(&w.name).is_some() {
                self.expect(&w.name, &w.shape)?;
            }
        }
        Ok(())
    }
}
