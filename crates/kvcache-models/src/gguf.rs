//! Reading GGUF files, once for every model: the header ([`GgufFile`]: metadata
//! and tensor directory, read once), one architecture's metadata (`Metadata`:
//! the keys under its prefix, `llama.` or `gemma3.`) and the tensors, each
//! checked against the shape the model expects as it is read (`Tensors`).
//! [`crate::ModelFile`] (the Llama) and [`crate::gemma::GemmaFile`] are built
//! on these.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::QTensor;
use candle_core::Device;

use crate::{ModelError, Result};

/// Progress of loading a model: `done` of `total` tensors read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadProgress {
    /// Tensors read so far.
    pub done: usize,
    /// Tensors to read.
    pub total: usize,
}

/// A GGUF file whose header (metadata and tensor directory) has been read.
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    content: gguf_file::Content,
}

impl GgufFile {
    /// Reads the header of the GGUF at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let content = gguf_file::Content::read(&mut open(&path)?)
            .map_err(|e| ModelError::Format(format!("{}: {e}", path.display())))?;
        Ok(GgufFile { path, content })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The architecture the header names (`general.architecture`: `llama`,
    /// `gemma3`, ...), `None` when it names none.
    pub fn architecture(&self) -> Option<&str> {
        architecture(&self.content.metadata)
    }

    /// The header's metadata, by key.
    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// Number of tensors in the file.
    pub fn tensor_count(&self) -> usize {
        self.content.tensor_infos.len()
    }

    /// The parsed header, as candle's GGUF reader holds it.
    pub fn content(&self) -> &gguf_file::Content {
        &self.content
    }

    /// `build` (a model's `from_gguf`) given the header and the file opened
    /// again for reading its tensors.
    pub(crate) fn build<T>(
        &self,
        build: impl FnOnce(&gguf_file::Content, &mut File) -> Result<T>,
    ) -> Result<T> {
        build(&self.content, &mut open(&self.path)?)
    }
}

fn open(path: &Path) -> Result<File> {
    File::open(path).map_err(|e| ModelError::io(path, e))
}

/// `general.architecture` of a header's metadata.
fn architecture(md: &HashMap<String, Value>) -> Option<&str> {
    match md.get("general.architecture") {
        Some(Value::String(arch)) => Some(arch),
        _ => None,
    }
}

/// The metadata of one architecture: the keys under its prefix, as typed values.
pub(crate) struct Metadata<'a> {
    md: &'a HashMap<String, Value>,
    arch: &'static str,
}

impl<'a> Metadata<'a> {
    /// `md`, checked to name `arch` as its architecture.
    pub(crate) fn of(md: &'a HashMap<String, Value>, arch: &'static str) -> Result<Self> {
        match architecture(md) {
            Some(named) if named == arch => Ok(Metadata { md, arch }),
            named => Err(ModelError::Format(format!(
                "architecture {:?} is not {arch}",
                named.unwrap_or("")
            ))),
        }
    }

    /// The value of `{arch}.{key}`.
    fn get(&self, key: &str) -> Result<&'a Value> {
        let key = format!("{}.{key}", self.arch);
        self.md
            .get(&key)
            .ok_or_else(|| ModelError::Format(format!("no {key} in the GGUF header")))
    }

    /// `{arch}.{key}`, an unsigned integer (32 or 64 bits).
    pub(crate) fn usize(&self, key: &str) -> Result<usize> {
        let v = self.get(key)?;
        v.to_u32()
            .map(|x| x as usize)
            .or_else(|_| v.to_u64().map(|x| x as usize))
            .map_err(|e| ModelError::Format(format!("{}.{key}: {e}", self.arch)))
    }

    /// `{arch}.{key}`, an f32.
    pub(crate) fn f32(&self, key: &str) -> Result<f32> {
        self.get(key)?
            .to_f32()
            .map_err(|e| ModelError::Format(format!("{}.{key}: {e}", self.arch)))
    }

    /// The number of tokens of the embedded tokenizer (`tokenizer.ggml.tokens`).
    pub(crate) fn token_count(&self) -> Result<usize> {
        self.md
            .get("tokenizer.ggml.tokens")
            .and_then(|v| v.to_vec().ok())
            .map(Vec::len)
            .ok_or_else(|| ModelError::Format("no tokenizer.ggml.tokens in the GGUF header".into()))
    }
}

/// A GGUF file's tensors read onto a device, each checked against the shape
/// the model expects, with `progress` called after each.
pub(crate) struct Tensors<'a, R> {
    content: &'a gguf_file::Content,
    reader: R,
    device: &'a Device,
    progress: &'a mut dyn FnMut(LoadProgress),
    done: usize,
}

impl<'a, R: Read + Seek> Tensors<'a, R> {
    /// Tensors of the file `reader` whose header is `content`.
    pub(crate) fn new(
        content: &'a gguf_file::Content,
        reader: R,
        device: &'a Device,
        progress: &'a mut dyn FnMut(LoadProgress),
    ) -> Self {
        Tensors {
            content,
            reader,
            device,
            progress,
            done: 0,
        }
    }

    /// Whether the file holds a tensor called `name`.
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// The tensor called `name` as stored (quantized or not), checked to have
    /// shape `dims` (outermost first).
    pub(crate) fn read(&mut self, name: &str, dims: &[usize]) -> Result<QTensor> {
        let t = self.read_any(name)?;
        check_shape(name, t.shape().dims(), dims)?;
        Ok(t)
    }

    /// The tensor called `name` as stored, whatever its shape.
    pub(crate) fn read_any(&mut self, name: &str) -> Result<QTensor> {
        let t = self
            .content
            .tensor(&mut self.reader, name, self.device)
            .map_err(|e| ModelError::Format(format!("tensor {name}: {e}")))?;
        self.done += 1;
        (self.progress)(LoadProgress {
            done: self.done,
            total: self.content.tensor_infos.len(),
        });
        Ok(t)
    }
}

/// A `Format` error unless the weight `name` of shape `dims` has the shape
/// `expected` (outermost first).
pub(crate) fn check_shape(name: &str, dims: &[usize], expected: &[usize]) -> Result<()> {
    if dims == expected {
        Ok(())
    } else {
        Err(ModelError::Format(format!(
            "{name} has shape {dims:?}, expected {expected:?}"
        )))
    }
}
