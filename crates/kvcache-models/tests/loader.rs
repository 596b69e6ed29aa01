//! The one loader ([`kvcache_models::loader`]): the real SmolLM2 file gives
//! the Llama with its name and fingerprint, the Gemma file (when present) the
//! Gemma; a header naming another architecture, or none, is a typed error;
//! the fingerprint is the file's and the weight mode's; a device spec parses
//! and a CUDA device this build lacks is an error, not a panic.

use std::io::Read;
use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use kvcache_api::Fingerprint;
use kvcache_models::loader::{self, Architecture, DeviceSpec, LoadedModel};
use kvcache_models::{Model, ModelError, WeightMode};
use kvcache_testkit::models::{model_file, TestModel};
use sha2::{Digest, Sha256};

/// SHA-256 of the domain tag, the mode and the file, written out here so the
/// stored keys cannot drift unnoticed.
fn expected_fingerprint(path: &Path, mode: WeightMode) -> Fingerprint {
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .unwrap()
        .read_to_end(&mut bytes)
        .unwrap();
    let mut hasher = Sha256::new();
    hasher.update(b"kvcache-engine GGUF model file\0");
    hasher.update(format!("{mode:?}\0").as_bytes());
    hasher.update(&bytes);
    Fingerprint(hasher.finalize().into())
}

#[test]
fn smollm2_loads_as_the_llama_with_its_name_tokenizer_and_fingerprint() {
    let Some(path) = model_file(TestModel::SmolLM2) else {
        return;
    };
    let source = loader::open(&path).unwrap();
    assert_eq!(source.architecture(), Architecture::Llama);
    let mode = WeightMode::FASTEST;
    let loaded = source.load(&Device::Cpu, mode, &mut |_| {}).unwrap();
    assert_eq!(loaded.name, "SmolLM2-135M-Instruct");
    assert_eq!(loaded.architecture(), Architecture::Llama);
    assert_eq!((loaded.path(), loaded.weights()), (path.as_path(), mode));
    let LoadedModel::Llama { model, tokenizer } = &loaded.model else {
        panic!("SmolLM2 loaded as {:?}", loaded.architecture());
    };
    assert_eq!(model.architecture(), "llama");
    assert_eq!(model.vocab_size(), 49152);
    assert!(model.device().is_cpu());
    assert_eq!(tokenizer.vocab_size(), 49152);
    // The shared tokenizer is the same one.
    let text = "Hello, cache!";
    assert_eq!(
        loaded.tokenizer().encode(text).unwrap(),
        tokenizer.encode(text).unwrap()
    );
    let fingerprint = loaded.fingerprint().unwrap();
    assert_eq!(fingerprint, expected_fingerprint(&path, mode));
    assert_eq!(loaded.fingerprint().unwrap(), fingerprint, "kept");
    // Another weight mode, another fingerprint: their prefixes never mix.
    let mut seen = std::collections::HashSet::new();
    for mode in [WeightMode::F32, WeightMode::Candle, WeightMode::FASTEST] {
        assert!(seen.insert(loader::fingerprint(&path, mode).unwrap()), "{mode}");
    }
}

#[test]
fn gemma_loads_as_the_gemma() {
    let Some(path) = model_file(TestModel::Gemma3) else {
        return;
    };
    let loaded = loader::load(&path, &Device::Cpu, WeightMode::FASTEST).unwrap();
    assert_eq!(loaded.architecture(), Architecture::Gemma3);
    assert_eq!(loaded.name, "gemma-3-270m");
    let LoadedModel::Gemma { model, .. } = &loaded.model else {
        panic!("Gemma loaded as {:?}", loaded.architecture());
    };
    assert_eq!(model.architecture(), "gemma3");
    assert_eq!(
        loaded.fingerprint().unwrap(),
        expected_fingerprint(&path, WeightMode::FASTEST)
    );
}

/// A GGUF of one tiny tensor whose header names `architecture` (or none).
fn tiny_gguf(dir: &Path, architecture: Option<&str>) -> std::path::PathBuf {
    let path = dir.join(format!("tiny-{}.gguf", architecture.unwrap_or("none")));
    let metadata: Vec<(&str, gguf_file::Value)> = architecture
        .map(|a| ("general.architecture", gguf_file::Value::String(a.into())))
        .into_iter()
        .collect();
    let t = Tensor::zeros((2, 32), candle_core::DType::F32, &Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, GgmlDType::F32).unwrap();
    let md: Vec<(&str, &gguf_file::Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let mut f = std::fs::File::create(&path).unwrap();
    gguf_file::write(&mut f, &md, &[("token_embd.weight", &q)]).unwrap();
    path
}

#[test]
fn an_architecture_the_loader_does_not_build_is_a_typed_error() {
    let dir = std::env::temp_dir().join(format!("kvcache-loader-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (architecture, found) in [(Some("mamba"), Some("mamba".to_string())), (None, None)] {
        let path = tiny_gguf(&dir, architecture);
        match loader::open(&path) {
            Err(ModelError::UnknownArchitecture { path: p, found: f }) => {
                assert_eq!((p, f), (path.display().to_string(), found));
            }
            other => panic!("{architecture:?}: {other:?}"),
        }
        let message = loader::load(&path, &Device::Cpu, WeightMode::F32)
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("architecture") && message.contains("llama, gemma3"),
            "{message}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(Architecture::from_gguf_name("gemma3"), Some(Architecture::Gemma3));
    assert_eq!(Architecture::from_gguf_name("llama"), Some(Architecture::Llama));
}

#[test]
fn devices_parse_and_a_missing_gpu_is_an_error_not_a_panic() {
    let parsed: Vec<DeviceSpec> = ["cpu", "cuda", "CUDA:3"]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
    assert_eq!(
        parsed,
        [DeviceSpec::Cpu, DeviceSpec::Cuda(0), DeviceSpec::Cuda(3)]
    );
    assert_eq!(DeviceSpec::Cuda(3).to_string(), "cuda:3");
    for bad in ["gpu", "cuda:", "cuda:x", ""] {
        assert!(
            matches!(bad.parse::<DeviceSpec>(), Err(ModelError::InvalidArgument(_))),
            "{bad}"
        );
    }
    assert!(DeviceSpec::Cpu.open().unwrap().is_cpu());
    if cfg!(not(feature = "cuda")) {
        match DeviceSpec::Cuda(0).open() {
            Err(ModelError::InvalidArgument(m)) => {
                assert!(m.contains("cuda:0") && m.contains("--features cuda"), "{m}")
            }
            other => panic!("{other:?}"),
        }
    }
}
