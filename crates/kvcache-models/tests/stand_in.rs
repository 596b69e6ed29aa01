//! Stand-in model files (`kvcache_models::stand_in`): a skeleton keeps a
//! GGUF's metadata and every tensor's name, shape and block type; filling it
//! gives a file of those shapes and types with seeded random weights (the same
//! bytes for the same seed), which loads as the real model does: same
//! tokenizer, same matrices, finite logits.

use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use kvcache_models::loader::{self, LoadedModel};
use kvcache_models::stand_in::{self, TensorEntry};
use kvcache_models::{GgufFile, ModelError, WeightMode};
use kvcache_testkit::models::{model_file, TestModel};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvcache-stand-in-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A small GGUF: metadata of three kinds and tensors in three block types.
fn small_gguf(path: &Path) {
    let metadata = [
        ("general.architecture", gguf_file::Value::String("llama".into())),
        ("llama.block_count", gguf_file::Value::U32(1)),
        (
            "tokenizer.ggml.tokens",
            gguf_file::Value::Array(vec![
                gguf_file::Value::String("a".into()),
                gguf_file::Value::String("b".into()),
            ]),
        ),
    ];
    let t = |rows: usize, cols: usize, v: f32| Tensor::full(v, (rows, cols), &Device::Cpu).unwrap();
    let tensors = [
        (
            "token_embd.weight",
            QTensor::quantize(&t(4, 256, 0.5), GgmlDType::Q6K).unwrap(),
        ),
        (
            "blk.0.attn_q.weight",
            QTensor::quantize(&t(8, 256, 0.25), GgmlDType::Q4K).unwrap(),
        ),
        (
            "blk.0.attn_norm.weight",
            QTensor::quantize(&t(1, 32, 1.0).squeeze(0).unwrap(), GgmlDType::F32).unwrap(),
        ),
        (
            "output.weight",
            QTensor::quantize(&t(2, 64, 2.0), GgmlDType::Q8_0).unwrap(),
        ),
    ];
    let md: Vec<(&str, &gguf_file::Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (*k, v)).collect();
    gguf_file::write(&mut std::fs::File::create(path).unwrap(), &md, &ts).unwrap();
}

/// The parsed header of the GGUF at `path`.
fn gguf_header(path: &Path) -> GgufFile {
    GgufFile::open(path).unwrap()
}

fn entry(name: &str, dtype: GgmlDType, shape: &[usize]) -> TensorEntry {
    TensorEntry {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
    }
}

#[test]
fn a_skeleton_fills_into_the_same_shapes_types_and_metadata() {
    let dir = scratch("small");
    let (model, skeleton) = (dir.join("m.gguf"), dir.join("m.skeleton.gguf"));
    small_gguf(&model);
    let written = stand_in::write_skeleton(&model, &skeleton).unwrap();
    let expected = vec![
        entry("token_embd.weight", GgmlDType::Q6K, &[4, 256]),
        entry("blk.0.attn_q.weight", GgmlDType::Q4K, &[8, 256]),
        entry("blk.0.attn_norm.weight", GgmlDType::F32, &[32]),
        entry("output.weight", GgmlDType::Q8_0, &[2, 64]),
    ];
    assert_eq!(
        (written.tensors.clone(), written.metadata_keys),
        (expected.clone(), 3)
    );
    assert_eq!(stand_in::read_skeleton(&skeleton).unwrap(), written);
    let header = gguf_header(&skeleton);
    assert_eq!(
        header.content().tensor_infos.len(),
        0,
        "a skeleton holds no tensors"
    );

    let (a, b, c) = (dir.join("a.gguf"), dir.join("b.gguf"), dir.join("c.gguf"));
    stand_in::fill(&skeleton, &a, 7).unwrap();
    stand_in::fill(&skeleton, &b, 7).unwrap();
    stand_in::fill(&skeleton, &c, 8).unwrap();
    let bytes = |p: &Path| std::fs::read(p).unwrap();
    assert_eq!(bytes(&a), bytes(&b), "the same seed, the same file");
    assert_ne!(bytes(&a), bytes(&c));
    assert!(!dir.join("a.partial").exists());

    let filled = gguf_header(&a);
    let original = gguf_header(&model);
    let mut keys: Vec<&String> = filled.content().metadata.keys().collect();
    keys.sort();
    let mut original_keys: Vec<&String> = original.content().metadata.keys().collect();
    original_keys.sort();
    assert_eq!(keys, original_keys, "the skeleton's own keys are left out");
    assert_eq!(
        filled.content().metadata["tokenizer.ggml.tokens"]
            .to_vec()
            .unwrap()
            .len(),
        2
    );
    let mut file = std::fs::File::open(&a).unwrap();
    for e in &expected {
        let t = filled.content().tensor(&mut file, &e.name, &Device::Cpu).unwrap();
        assert_eq!(
            (t.dtype(), t.shape().dims()),
            (e.dtype, e.shape.as_slice()),
            "{}",
            e.name
        );
        let values = t
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert!(values.iter().all(|v| v.is_finite()), "{}", e.name);
        if e.name.contains("norm") {
            assert!(
                values.iter().all(|v| (0.8..=1.2).contains(v)),
                "{}: {values:?}",
                e.name
            );
        } else {
            // Uniform with variance 1 / fan_in, within the block type's rounding.
            let bound = 1.1 * (3.0 / e.shape[1] as f32).sqrt();
            assert!(values.iter().all(|v| v.abs() <= bound), "{}", e.name);
            let mean_sq = values.iter().map(|v| v * v).sum::<f32>() / values.len() as f32;
            let expected = 1.0 / e.shape[1] as f32;
            assert!(
                (mean_sq / expected - 1.0).abs() < 0.25,
                "{}: {mean_sq} vs {expected}",
                e.name
            );
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn what_is_not_a_model_or_not_a_skeleton_is_refused() {
    let dir = scratch("refused");
    let (model, skeleton) = (dir.join("m.gguf"), dir.join("s.gguf"));
    small_gguf(&model);
    stand_in::write_skeleton(&model, &skeleton).unwrap();
    let out = dir.join("out.gguf");
    assert!(matches!(
        stand_in::fill(&model, &out, 0),
        Err(ModelError::Format(m)) if m.contains("not a skeleton")
    ));
    assert!(matches!(
        stand_in::write_skeleton(&skeleton, &out),
        Err(ModelError::InvalidArgument(m)) if m.contains("skeleton already")
    ));
    assert!(stand_in::write_skeleton(&dir.join("missing.gguf"), &out).is_err());
    assert!(!out.exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn smollm2_stands_in_with_its_tokenizer_and_matrices() {
    let Some(path) = model_file(TestModel::SmolLM2) else {
        return;
    };
    let dir = scratch("smollm2");
    let (skeleton, stand_in_path) = (dir.join("s.gguf"), dir.join("smollm2.gguf"));
    let written = stand_in::write_skeleton(&path, &skeleton).unwrap();
    let skeleton_bytes = std::fs::metadata(&skeleton).unwrap().len();
    assert!(skeleton_bytes < 8 << 20, "{skeleton_bytes} bytes");
    stand_in::fill(&skeleton, &stand_in_path, 1).unwrap();
    let (real, fake) = (gguf_header(&path), gguf_header(&stand_in_path));
    assert_eq!(real.content().tensor_infos.len(), written.tensors.len());
    for (name, info) in &real.content().tensor_infos {
        let other = &fake.content().tensor_infos[name];
        assert_eq!(
            (other.ggml_dtype, other.shape.dims()),
            (info.ggml_dtype, info.shape.dims()),
            "{name}"
        );
    }
    let load = |p: &Path| loader::load(p, &Device::Cpu, WeightMode::F32).unwrap();
    let (real, fake) = (load(&path), load(&stand_in_path));
    let text = "The cache keeps what the model computed.";
    assert_eq!(
        real.tokenizer().encode(text).unwrap(),
        fake.tokenizer().encode(text).unwrap()
    );
    let LoadedModel::Llama { model, .. } = &fake.model else {
        panic!("the stand-in loads as {:?}", fake.architecture());
    };
    let tokens = real.tokenizer().encode(text).unwrap();
    let logits = model.forward_full(&tokens, None).unwrap();
    assert_eq!(logits.dims(), [tokens.len(), 49152]);
    let logits = logits.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert!(logits.iter().all(|v| v.is_finite()));
    assert_ne!(fake.fingerprint().unwrap(), real.fingerprint().unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
}
