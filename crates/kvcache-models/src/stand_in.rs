//! Stand-in model files: a GGUF's header (its metadata, tokenizer included,
//! and the name, shape and block type of every tensor) kept as a small
//! *skeleton*, from which a file of the same shapes and types with
//! pseudo-random weights is made again elsewhere.
//!
//! A lent GPU machine has no network and takes 64 MiB of files; SmolLM2 and
//! Gemma 3 are larger. Their skeletons are a few MB: the machine fills them
//! ([`fill`]) into files every program loads as it would the real ones: the
//! same tokenizer and chat template, the same matrices in the same 4-, 6- and
//! 8-bit blocks, so the bytes moved per token, and so the timings, are the
//! real model's. Only the answers are noise.
//!
//! The skeleton is itself a GGUF: the original metadata plus three arrays
//! under `kvcache.stand_in.` (tensor names, their block types by name, their
//! shapes), and no tensors. [`fill`] draws each tensor from a generator
//! seeded by the seed and the tensor's name, so a file is the same however
//! its tensors are scheduled: norm weights near 1, other values uniform with
//! variance `1 / fan_in` (the random test models' draws), quantized to the
//! recorded type by candle.

use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rayon::prelude::*;

use crate::gguf::GgufFile;
use crate::weights::{Draw, SplitMix64};
use crate::{ModelError, Result};

/// The metadata key of the tensor names of a skeleton.
const NAMES: &str = "kvcache.stand_in.names";
/// The metadata key of the tensors' block types (candle's names: `Q4K`, `F32`, ...).
const TYPES: &str = "kvcache.stand_in.types";
/// The metadata key of the tensors' shapes (`"576,49152"`, outermost first).
const SHAPES: &str = "kvcache.stand_in.shapes";

/// The block types a skeleton may name.
const DTYPES: [GgmlDType; 15] = [
    GgmlDType::F32,
    GgmlDType::F16,
    GgmlDType::BF16,
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q8_0,
    GgmlDType::Q8_1,
    GgmlDType::Q2K,
    GgmlDType::Q3K,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
    GgmlDType::Q8K,
];

/// One tensor of a skeleton.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    /// The GGUF name (`blk.0.attn_q.weight`, ...).
    pub name: String,
    /// The block type it is stored in.
    pub dtype: GgmlDType,
    /// Its dimensions, outermost first.
    pub shape: Vec<usize>,
}

/// What a skeleton describes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skeleton {
    /// The tensors, in the order of the original file.
    pub tensors: Vec<TensorEntry>,
    /// How many metadata keys the original file holds.
    pub metadata_keys: usize,
}

/// Writes the skeleton of the GGUF at `model` to `out` (written aside, then
/// renamed) and returns what it describes.
pub fn write_skeleton(model: &Path, out: &Path) -> Result<Skeleton> {
    let file = GgufFile::open(model)?;
    let content = file.content();
    let mut infos: Vec<_> = content.tensor_infos.iter().collect();
    infos.sort_by_key(|(name, info)| (info.offset, name.as_str()));
    let tensors: Vec<TensorEntry> = infos
        .into_iter()
        .map(|(name, info)| TensorEntry {
            name: name.clone(),
            dtype: info.ggml_dtype,
            shape: info.shape.dims().to_vec(),
        })
        .collect();
    if let Some(key) = content
        .metadata
        .keys()
        .find(|k| k.starts_with("kvcache.stand_in."))
    {
        return Err(ModelError::InvalidArgument(format!(
            "{} is a skeleton already (it holds {key})",
            model.display()
        )));
    }
    let strings = |f: &dyn Fn(&TensorEntry) -> String| {
        Value::Array(tensors.iter().map(|t| Value::String(f(t))).collect())
    };
    let listing = [
        (NAMES, strings(&|t| t.name.clone())),
        (TYPES, strings(&|t| format!("{:?}", t.dtype))),
        (SHAPES, strings(&|t| join(&t.shape))),
    ];
    let mut metadata = sorted(&content.metadata);
    metadata.extend(listing.iter().map(|(k, v)| (*k, v)));
    write_aside(out, |w| gguf_file::write(w, &metadata, &[]))?;
    Ok(Skeleton {
        tensors,
        metadata_keys: content.metadata.len(),
    })
}

/// Reads what the skeleton at `path` describes.
pub fn read_skeleton(path: &Path) -> Result<Skeleton> {
    let file = GgufFile::open(path)?;
    let md = &file.content().metadata;
    let strings = |key: &str| -> Result<Vec<String>> {
        let bad = || {
            ModelError::Format(format!(
                "{}: no string array {key}: not a skeleton",
                path.display()
            ))
        };
        match md.get(key) {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.to_string().cloned().map_err(|_| bad()))
                .collect(),
            _ => Err(bad()),
        }
    };
    let (names, types, shapes) = (strings(NAMES)?, strings(TYPES)?, strings(SHAPES)?);
    if names.len() != types.len() || names.len() != shapes.len() {
        return Err(ModelError::Format(format!(
            "{}: {} names, {} types and {} shapes",
            path.display(),
            names.len(),
            types.len(),
            shapes.len()
        )));
    }
    let tensors = names
        .into_iter()
        .zip(types)
        .zip(shapes)
        .map(|((name, dtype), shape)| {
            let dtype = DTYPES
                .into_iter()
                .find(|d| format!("{d:?}") == dtype)
                .ok_or_else(|| ModelError::Format(format!("tensor {name}: no block type {dtype:?}")))?;
            let shape = shape
                .split(',')
                .map(|d| d.parse::<usize>())
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|_| ModelError::Format(format!("tensor {name}: shape {shape:?}")))?;
            Ok(TensorEntry { name, dtype, shape })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Skeleton {
        tensors,
        metadata_keys: md.keys().filter(|k| !k.starts_with("kvcache.stand_in.")).count(),
    })
}

/// Makes the model file `out` (written aside, then renamed) from the
/// skeleton at `skeleton`: its metadata, and every tensor it lists drawn from
/// `seed` and quantized to its type (tensors in parallel on rayon's pool).
pub fn fill(skeleton: &Path, out: &Path, seed: u64) -> Result<Skeleton> {
    let described = read_skeleton(skeleton)?;
    let file = GgufFile::open(skeleton)?;
    let metadata: Vec<(&str, &Value)> = sorted(&file.content().metadata)
        .into_iter()
        .filter(|(k, _)| !k.starts_with("kvcache.stand_in."))
        .collect();
    let tensors = described
        .tensors
        .par_iter()
        .map(|t| draw(t, seed))
        .collect::<Result<Vec<QTensor>>>()?;
    let named: Vec<(&str, &QTensor)> = described
        .tensors
        .iter()
        .map(|t| t.name.as_str())
        .zip(&tensors)
        .collect();
    write_aside(out, |w| gguf_file::write(w, &metadata, &named))?;
    Ok(described)
}

/// The tensor `t` drawn from `seed` (and its name) in its block type.
fn draw(t: &TensorEntry, seed: u64) -> Result<QTensor> {
    let n: usize = t.shape.iter().product();
    let fan_in = t.shape.last().copied().unwrap_or(1);
    let rule = if t.name.contains("norm") {
        Draw::NORM
    } else if t.shape.len() >= 2 {
        Draw::matrix(fan_in)
    } else {
        Draw::new(0.02, 0.0)
    };
    let mut rng = SplitMix64(seed ^ fnv1a(t.name.as_bytes()));
    let values = Tensor::from_vec(rule.values(&mut rng, n), t.shape.as_slice(), &Device::Cpu)?;
    QTensor::quantize(&values, t.dtype)
        .map_err(|e| ModelError::Format(format!("tensor {} as {:?}: {e}", t.name, t.dtype)))
}

/// The metadata by key, sorted (so that a file's bytes do not depend on a hash order).
fn sorted(md: &std::collections::HashMap<String, Value>) -> Vec<(&str, &Value)> {
    let mut entries: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    entries.sort_by_key(|(k, _)| *k);
    entries
}

/// Writes `out` through `write` into a file beside it, synced, then renamed over it.
fn write_aside(
    out: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> candle_core::Result<()>,
) -> Result<()> {
    let partial = out.with_extension("partial");
    let io = |e| ModelError::io(&partial, e);
    let mut w = BufWriter::new(File::create(&partial).map_err(io)?);
    write(&mut w).map_err(|e| ModelError::Format(format!("writing {}: {e}", partial.display())))?;
    let file = w.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)?;
    std::fs::rename(&partial, out).map_err(|e| ModelError::io(out, e))
}

fn join(dims: &[usize]) -> String {
    dims.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
}

/// FNV-1a over `bytes`: a tensor's own stream of the seed.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
