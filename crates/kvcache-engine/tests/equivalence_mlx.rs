//! The Llama on mlx-rs through kvcache-mlx: for random conversation schedules
//! (new, extend, branch, switch back, repeat) under small byte budgets, every
//! logit row computed through the prefix trie and its mlx `KvCache`s equals a
//! full recompute without any cache within 1e-5, on a tiny random-weight Llama.
//! Also: the mlx full recompute equals the candle one on the same (tiny) GGUF,
//! and the mlx chat generates the tokens of full recomputation.
#![cfg(any(target_os = "macos", kvcache_mlx))]

mod mlx_support;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use kvcache_api::{LayerCache, SnapshotCache};
use kvcache_engine::chat::Reuse;
use kvcache_engine::mlx::MlxChat;
use kvcache_mlx::layers::KvCache;
use kvcache_models::argmax;
use kvcache_models::mlx::model::to_host;
use kvcache_models::mlx::{HostWeights, MlxLlama};
use kvcache_models::ModelError;
use kvcache_models::{LlamaConfig, ModelFile, WeightMode};
use mlx_support::{bytes_per_position, max_abs_diff, Driver};
use proptest::prelude::*;

const TOL: f32 = 1e-5;

fn model() -> MlxLlama {
    MlxLlama::random(LlamaConfig::tiny(), 7).unwrap()
}

#[derive(Debug, Clone)]
enum Request {
    /// A new conversation of `len` fresh tokens.
    New(usize),
    /// Continue conversation `conv` (modulo the count) with `len` more tokens.
    Extend(usize, usize),
    /// Branch conversation `conv` at `at` percent of its length with `len` tokens.
    Branch(usize, u8, usize),
    /// Repeat conversation `conv` exactly.
    Repeat(usize),
}

fn request() -> impl Strategy<Value = Request> {
    prop_oneof![
        2 => (1usize..12).prop_map(Request::New),
        3 => (0usize..8, 1usize..8).prop_map(|(c, l)| Request::Extend(c, l)),
        2 => (0usize..8, 0u8..100, 1usize..6).prop_map(|(c, a, l)| Request::Branch(c, a, l)),
        1 => (0usize..8).prop_map(Request::Repeat),
    ]
}

/// Runs `requests` through a trie with `budget` bytes, each request generating
/// `generate` tokens; returns the driver for its counters.
fn run_schedule<'m>(model: &'m MlxLlama, requests: &[Request], budget: usize, generate: usize) -> Driver<'m> {
    let vocab = model.config().vocab_size as u64;
    let mut driver = Driver::new(model, 4, budget);
    let mut conversations: Vec<Vec<u32>> = vec![];
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut fresh = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state % vocab) as u32
            })
            .collect()
    };
    for request in requests {
        let conv = match (request, conversations.len()) {
            (Request::New(len), _) => {
                conversations.push(fresh(*len));
                conversations.len() - 1
            }
            (_, 0) => {
                conversations.push(fresh(3));
                0
            }
            (Request::Extend(c, len), n) => {
                let more = fresh(*len);
                conversations[c % n].extend(more);
                c % n
            }
            (Request::Branch(c, at, len), n) => {
                let base = &conversations[c % n];
                let mut branch = base[..base.len() * *at as usize / 100].to_vec();
                branch.extend(fresh(*len));
                conversations.push(branch);
                conversations.len() - 1
            }
            (Request::Repeat(c), n) => c % n,
        };
        let prompt = conversations[conv].clone();
        let (held, _) = driver.request(&prompt, generate);
        conversations[conv] = held;
    }
    driver
}

proptest! {
    // 24 cases unless PROPTEST_CASES says otherwise.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(24),
        ..ProptestConfig::default()
    })]

    #[test]
    fn trie_schedules_equal_full_recompute(
        requests in prop::collection::vec(request(), 1..14),
        budget_positions in prop_oneof![Just(0usize), Just(12), Just(usize::MAX)],
        generate in 0usize..4,
    ) {
        let model = model();
        let budget = budget_positions.saturating_mul(bytes_per_position(&model));
        let driver = run_schedule(&model, &requests, budget, generate);
        prop_assert!(
            driver.max_diff <= TOL,
            "max |cached - recomputed| = {} over {} rows ({:?})",
            driver.max_diff,
            driver.rows,
            driver.stats()
        );
    }
}

/// A fixed schedule under a budget of 16 positions that extends, branches,
/// switches back and evicts, with the trie's counters checked so a change of
/// schedule cannot silently stop covering paging and eviction.
#[test]
fn fixed_schedule_pages_in_out_and_evicts() {
    let model = model();
    let budget = 16 * bytes_per_position(&model);
    let requests = [
        Request::New(10),
        Request::New(6),
        Request::Extend(0, 5),
        Request::Branch(0, 50, 4),
        Request::Extend(1, 7),
        Request::Repeat(0),
        Request::Branch(3, 30, 5),
        Request::Extend(0, 3),
        Request::New(9),
        Request::Extend(2, 2),
        Request::Extend(1, 3),
        Request::Repeat(3),
    ];
    let driver = run_schedule(&model, &requests, budget, 3);
    let stats = driver.stats();
    println!(
        "tiny fixed schedule: max diff {} over {} rows; {stats:?}",
        driver.max_diff, driver.rows
    );
    assert!(driver.max_diff <= TOL, "{} ({stats:?})", driver.max_diff);
    assert!(stats.hits >= 6, "{stats:?}");
    assert!(stats.page_outs > 0 && stats.page_ins > 0, "{stats:?}");
    assert!(stats.evictions > 0, "{stats:?}");
    assert!(driver.rows > 80, "{}", driver.rows);
}

/// Feeding tokens one by one, in chunks, or all at once through `KvCache`s
/// gives the full recompute's logits, including past the cache's growth step.
#[test]
fn layer_caches_equal_full_recompute() {
    let model = model();
    let c = model.config().clone();
    let tokens: Vec<u32> = (0..40).map(|i| (i * 11 % 64) as u32).collect();
    let full = to_host(&model.forward_full(&tokens).unwrap()).unwrap();
    let v = c.vocab_size;
    for chunks in [vec![40], vec![7, 1, 1, 20, 11], vec![1; 40]] {
        let mut caches: Vec<KvCache> = (0..c.n_layers).map(|_| KvCache::with_step(8).unwrap()).collect();
        let mut at = 0;
        for n in chunks {
            let h = model.hidden_layers(&tokens[at..at + n], &mut caches).unwrap();
            let got = to_host(&model.logits(&h).unwrap()).unwrap();
            let d = max_abs_diff(&got, &full[at * v..(at + n) * v]);
            assert!(d <= TOL, "tokens {at}..{}: {d}", at + n);
            at += n;
        }
        assert!(caches.iter().all(|l| l.offset() == 40 && l.capacity() == 40));
        assert_eq!(caches[0].state()[0].shape(), &[1, 2, 40, 8]);
    }
}

/// Bad calls are refused before any cache changes.
#[test]
fn bad_calls_leave_the_caches_alone() {
    let model = model();
    let mut caches: Vec<KvCache> = (0..2).map(|_| KvCache::new()).collect();
    model.hidden_layers(&[1, 2, 3], &mut caches).unwrap();
    let before: Vec<usize> = caches.iter().map(|l| l.offset()).collect();
    let invalid = |r: kvcache_models::Result<mlx_rs::Array>| matches!(r, Err(ModelError::InvalidArgument(_)));
    assert!(
        invalid(model.hidden_layers(&[64], &mut caches)),
        "token outside the vocabulary"
    );
    assert!(invalid(model.hidden_layers(&[], &mut caches)), "no tokens");
    assert!(
        invalid(model.hidden_layers(&[1], &mut caches[..1])),
        "one cache for two layers"
    );
    caches[1].restore(None, 2).unwrap();
    assert!(
        invalid(model.hidden_layers(&[1], &mut caches)),
        "layers at different offsets"
    );
    assert_eq!(caches[0].offset(), before[0]);
    assert_eq!(caches[1].offset(), 2);
}

/// Writes `w` as an all-f32 GGUF that `ModelFile` can read.
fn write_gguf(w: &HostWeights, path: &std::path::Path) {
    use gguf_file::Value;
    let c = w.config();
    let u = |x: usize| Value::U32(x as u32);
    let metadata = [
        ("general.architecture", Value::String("llama".into())),
        ("llama.block_count", u(c.n_layers)),
        ("llama.embedding_length", u(c.dim)),
        ("llama.attention.head_count", u(c.n_heads)),
        ("llama.attention.head_count_kv", u(c.n_kv_heads)),
        ("llama.rope.dimension_count", u(c.head_dim)),
        ("llama.feed_forward_length", u(c.ffn_dim)),
        ("llama.vocab_size", u(c.vocab_size)),
        ("llama.context_length", u(c.context_length)),
        ("llama.rope.freq_base", Value::F32(c.rope_base as f32)),
        (
            "llama.attention.layer_norm_rms_epsilon",
            Value::F32(c.rms_eps as f32),
        ),
    ];
    let tensors: Vec<(String, QTensor)> = w
        .iter()
        .map(|(name, t)| {
            let t = Tensor::from_vec(t.data.clone(), t.shape.as_slice(), &Device::Cpu).unwrap();
            (name.to_string(), QTensor::quantize(&t, GgmlDType::F32).unwrap())
        })
        .collect();
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &md, &ts).unwrap();
}

/// The same GGUF loaded by the candle model and by the mlx model gives the
/// same logits without any cache.
#[test]
fn mlx_full_recompute_equals_candle_on_a_tiny_gguf() {
    let weights = HostWeights::random(LlamaConfig::tiny(), 5).unwrap();
    let path = std::env::temp_dir().join(format!("kvcache-engine-tiny-{}.gguf", std::process::id()));
    write_gguf(&weights, &path);
    let file = ModelFile::open(&path).unwrap();
    let candle = file.load(&Device::Cpu, WeightMode::F32, &mut |_| {});
    let mut seen = 0;
    let mlx = MlxLlama::load(&file, &mut |p| seen = p.done);
    std::fs::remove_file(&path).unwrap();
    let (candle, mlx) = (candle.unwrap(), mlx.unwrap());
    // GGUF stores the epsilon as an f32.
    let mut config = LlamaConfig::tiny();
    config.rms_eps = f64::from(config.rms_eps as f32);
    assert_eq!(mlx.config(), &config);
    assert_eq!(seen, file.tensor_count());
    let tokens: Vec<u32> = (0..33).map(|i| (i * 29 % 64) as u32).collect();
    let want = candle
        .forward_full(&tokens, None)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let got = to_host(&mlx.forward_full(&tokens).unwrap()).unwrap();
    let d = max_abs_diff(&got, &want);
    println!("tiny model, mlx vs candle full recompute: max abs diff {d}");
    assert!(d <= TOL, "{d}");
}

/// Interleaved conversations through the mlx chat: the tokens it
/// generates are the greedy tokens of full recomputation, and later turns reuse
/// their conversation's earlier prompt.
#[test]
fn the_chat_generates_the_tokens_of_full_recompute() {
    let model = model();
    let mut chat = MlxChat::new(&model, Reuse::Trie, 1 << 30).unwrap();
    let system: Vec<u32> = (0..20).map(|i| (i * 7 % 60) as u32).collect();
    let mut convs: Vec<Vec<u32>> = vec![system.clone(); 3];
    let mut outs = Vec::new();
    for turn in 0..3 {
        for (c, conv) in convs.iter_mut().enumerate() {
            conv.extend((0..5 + c).map(|i| ((turn * 17 + c * 5 + i * 3) % 64) as u32));
            let out = chat.generate(conv, 4, None).unwrap();
            chat.trie().expect("a trie chat").check();
            let mut all = conv.clone();
            for &t in &out.generated {
                let logits = to_host(&model.forward_full(&all).unwrap()).unwrap();
                assert_eq!(
                    argmax(&logits[logits.len() - 64..]),
                    t,
                    "turn {turn}, conversation {c}"
                );
                all.push(t);
            }
            assert_eq!(out.matched + out.evaluated, out.prompt_tokens);
            outs.push((turn, out.clone()));
            conv.extend(&out.generated);
        }
    }
    // The second conversation's first turn shares the system prompt; every
    // later turn restores at least its conversation's previous prompt.
    assert_eq!(outs[1].1.matched, 20);
    for (i, (turn, out)) in outs.iter().enumerate() {
        if *turn > 0 {
            let prev = &outs[i - 3].1;
            assert!(out.matched >= prev.prompt_tokens, "request {i}: {out:?}");
        }
    }
    let stats = chat.trie_stats().expect("a trie chat");
    assert!(stats.page_outs > 0 && stats.page_ins > 0, "{stats:?}");
}
