//! The one way a program gets a model: [`open`] a GGUF (its header read
//! once), see its [`Architecture`], then [`ModelSource::load`] it with the
//! [`Device`] and [`WeightMode`] the caller chose. What comes back,
//! [`Loaded`], holds the model and its tokenizer as a typed pair
//! ([`LoadedModel`]: Llama or Gemma 3), the name a server lists, and the
//! fingerprint a prefix store keys its entries with.
//!
//! No caller picks a model by its architecture's string: an architecture the
//! loader does not know is [`ModelError::UnknownArchitecture`] at open, and a
//! device this build or machine cannot give ([`DeviceSpec::open`]) or a weight
//! mode the device cannot hold is an error before any weight is read.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use candle_core::Device;
use kvcache_api::Fingerprint;
use sha2::{Digest, Sha256};

use crate::gemma::{Gemma, GemmaFile, GemmaTokenizer};
use crate::{
    ChatTokenizer, GgufFile, Llama, LoadProgress, ModelError, ModelFile, Result, Tokenizer, WeightMode,
};

/// The architectures the loader builds, as a GGUF header names them
/// (`general.architecture`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Architecture {
    /// `llama`: SmolLM2 and other Llama-architecture models ([`Llama`]).
    Llama,
    /// `gemma3`: Gemma 3, window and global layers ([`Gemma`]).
    Gemma3,
}

impl Architecture {
    /// Every architecture the loader knows.
    pub const ALL: [Architecture; 2] = [Architecture::Llama, Architecture::Gemma3];

    /// The name GGUF writes (`llama`, `gemma3`).
    pub fn gguf_name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Gemma3 => "gemma3",
        }
    }

    /// The architecture a header names, if the loader knows it.
    pub fn from_gguf_name(name: &str) -> Option<Architecture> {
        Architecture::ALL.into_iter().find(|a| a.gguf_name() == name)
    }

    /// The model name a server lists when told none: the model the project
    /// prepares for this architecture (`SmolLM2-135M-Instruct`, `gemma-3-270m`).
    pub fn default_name(self) -> &'static str {
        match self {
            Architecture::Llama => "SmolLM2-135M-Instruct",
            Architecture::Gemma3 => "gemma-3-270m",
        }
    }
}

impl std::fmt::Display for Architecture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.gguf_name())
    }
}

/// Where a model runs, as a flag names it: `cpu`, `cuda` (the first GPU) or
/// `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DeviceSpec {
    /// The CPU.
    #[default]
    Cpu,
    /// The NVIDIA GPU of this ordinal (needs the `cuda` feature).
    Cuda(usize),
}

impl DeviceSpec {
    /// The device, or [`ModelError::InvalidArgument`] saying why not (a build
    /// without the `cuda` feature, no such GPU); never a panic.
    pub fn open(self) -> Result<Device> {
        match self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(ordinal) => Device::new_cuda(ordinal).map_err(|e| {
                let why = if cfg!(feature = "cuda") {
                    e.to_string()
                } else {
                    "this build has no CUDA support (build with `--features cuda` and the CUDA toolkit)"
                        .to_string()
                };
                ModelError::InvalidArgument(format!("device {self}: {why}"))
            }),
        }
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(ordinal) => write!(f, "cuda:{ordinal}"),
        }
    }
}

impl std::str::FromStr for DeviceSpec {
    type Err = ModelError;

    /// `cpu`, `cuda` (ordinal 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim().to_ascii_lowercase();
        let bad = || ModelError::InvalidArgument(format!("device {s:?}: expected cpu, cuda or cuda:N"));
        match s.as_str() {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            _ => {
                let ordinal = s.strip_prefix("cuda:").ok_or_else(bad)?;
                ordinal.parse().map(DeviceSpec::Cuda).map_err(|_| bad())
            }
        }
    }
}

/// A GGUF file whose header has been read once and names an architecture
/// the loader knows: what [`load`](ModelSource::load) will build.
#[derive(Debug)]
pub struct ModelSource {
    gguf: GgufFile,
    architecture: Architecture,
}

/// Reads the header of the GGUF at `path` and checks its architecture:
/// [`ModelError::UnknownArchitecture`] for one the loader does not build.
pub fn open(path: impl AsRef<Path>) -> Result<ModelSource> {
    let gguf = GgufFile::open(path)?;
    let architecture = match gguf.architecture() {
        Some(name) => Architecture::from_gguf_name(name),
        None => None,
    };
    let Some(architecture) = architecture else {
        return Err(ModelError::UnknownArchitecture {
            path: gguf.path().display().to_string(),
            found: gguf.architecture().map(str::to_string),
        });
    };
    Ok(ModelSource { gguf, architecture })
}

impl ModelSource {
    /// The architecture the header names.
    pub fn architecture(&self) -> Architecture {
        self.architecture
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        self.gguf.path()
    }

    /// The header.
    pub fn gguf(&self) -> &GgufFile {
        &self.gguf
    }

    /// Reads every weight onto `device` as `weights` says (`progress` after
    /// each tensor) and the tokenizer from the header. A weight mode the
    /// device cannot hold ([`WeightMode::check_device`]: the packed modes
    /// run on the CPU only) is refused before any weight is read.
    pub fn load(
        self,
        device: &Device,
        weights: WeightMode,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Loaded> {
        weights.check_device(device)?;
        let path = self.gguf.path().to_path_buf();
        let architecture = self.architecture;
        let model = match architecture {
            Architecture::Llama => {
                let file = ModelFile::from(self.gguf);
                let tokenizer = Arc::new(file.tokenizer()?);
                LoadedModel::Llama {
                    model: file.load(device, weights, progress)?,
                    tokenizer,
                }
            }
            Architecture::Gemma3 => {
                let file = GemmaFile::from(self.gguf);
                let tokenizer = Arc::new(file.tokenizer()?);
                LoadedModel::Gemma {
                    model: file.load(device, weights, progress)?,
                    tokenizer,
                }
            }
        };
        Ok(Loaded {
            model,
            name: architecture.default_name().to_string(),
            architecture,
            path,
            weights,
            fingerprint: OnceLock::new(),
        })
    }
}

/// [`open`], then [`ModelSource::load`]: the model at `path` on `device`
/// with `weights`.
pub fn load(path: impl AsRef<Path>, device: &Device, weights: WeightMode) -> Result<Loaded> {
    open(path)?.load(device, weights, &mut |_| {})
}

/// A loaded model and its tokenizer, typed by architecture: an engine is
/// generic over [`crate::Model`], so a caller matches once and runs the same
/// generic code on either.
#[derive(Debug)]
pub enum LoadedModel {
    /// A Llama (SmolLM2) and its byte-level BPE with ChatML.
    Llama {
        /// The model.
        model: Llama,
        /// Its tokenizer.
        tokenizer: Arc<ChatTokenizer>,
    },
    /// Gemma 3 and its SentencePiece-style tokenizer.
    Gemma {
        /// The model.
        model: Gemma,
        /// Its tokenizer.
        tokenizer: Arc<GemmaTokenizer>,
    },
}

/// What [`ModelSource::load`] gives: the model and tokenizer, the name a
/// server lists, and (on first ask) the prefix store's fingerprint.
#[derive(Debug)]
pub struct Loaded {
    /// The model and its tokenizer.
    pub model: LoadedModel,
    /// The name clients see ([`Architecture::default_name`]; a server may
    /// list another).
    pub name: String,
    architecture: Architecture,
    path: PathBuf,
    weights: WeightMode,
    fingerprint: OnceLock<Fingerprint>,
}

impl Loaded {
    /// The architecture the file named.
    pub fn architecture(&self) -> Architecture {
        self.architecture
    }

    /// The file the model came from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How the weights are held and multiplied.
    pub fn weights(&self) -> WeightMode {
        self.weights
    }

    /// The tokenizer, shared.
    pub fn tokenizer(&self) -> Arc<dyn Tokenizer> {
        match &self.model {
            LoadedModel::Llama { tokenizer, .. } => tokenizer.clone(),
            LoadedModel::Gemma { tokenizer, .. } => tokenizer.clone(),
        }
    }

    /// The fingerprint a prefix store keys this model's entries with
    /// ([`fingerprint`] of the file and the weight mode). Hashing the file
    /// takes about half a second per 100 MB, so it is computed on the first
    /// call (only a store needs it) and kept.
    pub fn fingerprint(&self) -> Result<Fingerprint> {
        if let Some(fingerprint) = self.fingerprint.get() {
            return Ok(*fingerprint);
        }
        let fingerprint = fingerprint(&self.path, self.weights)?;
        Ok(*self.fingerprint.get_or_init(|| fingerprint))
    }
}

/// The fingerprint of the model in `path` loaded with `weights`: SHA-256 of a
/// domain tag, the weight mode and the GGUF file's bytes (dequantized and
/// quantized weights give different keys and values, so their prefixes must
/// not mix).
pub fn fingerprint(path: &Path, weights: WeightMode) -> Result<Fingerprint> {
    let mut file = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
    let mut hasher = Sha256::new();
    // The domain tag keys every stored block: changing it orphans stored data.
    hasher.update(b"kvcache-engine GGUF model file\0");
    hasher.update(format!("{weights:?}\0").as_bytes());
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buffer).map_err(|e| ModelError::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
    }
    Ok(Fingerprint(hasher.finalize().into()))
}
