//! SmolLM2-135M-Instruct (f32) on mlx-rs: its full recompute equals candle's
//! within 1e-3, logits through the prefix trie and mlx `KvCache`s equal its full
//! recompute within 1e-3 over a schedule that branches, switches back and
//! evicts, and the mlx chat answers a simple question.
//!
//! The model comes from `$KVCACHE_MODEL` (set by `cargo xtask test`) or the
//! download cache. Without it each test prints one line and passes, unless `CI`
//! is set, where a missing model is a failure.
#![cfg(any(target_os = "macos", kvcache_mlx))]

mod mlx_support;

use std::sync::OnceLock;

use candle_core::Device;
use kvcache_engine::chat::Reuse;
use kvcache_engine::mlx::MlxChat;
use kvcache_models::mlx::model::to_host;
use kvcache_models::mlx::{HostWeights, MlxLlama};
use kvcache_models::tokenizer::{chatml, Message, Role};
use kvcache_models::{ChatTokenizer, LlamaConfig, ModelFile, WeightMode};
use kvcache_testkit::models::{model_file, TestModel};
use mlx_support::{bytes_per_position, max_abs_diff, Driver};

const TOL: f32 = 1e-3;

struct Loaded {
    file: ModelFile,
    weights: HostWeights,
    tokenizer: ChatTokenizer,
}

/// The model file, its weights as host data (mlx arrays are not `Sync`, so each
/// test builds its own [`MlxLlama`] from these) and the tokenizer.
fn loaded() -> Option<&'static Loaded> {
    static LOADED: OnceLock<Option<Loaded>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let path = model_file(TestModel::SmolLM2)?;
            let file = ModelFile::open(&path).unwrap();
            let weights = HostWeights::load(&file, &mut |_| {}).unwrap();
            let tokenizer = file.tokenizer().unwrap();
            Some(Loaded {
                file,
                weights,
                tokenizer,
            })
        })
        .as_ref()
}

fn prompt(tokenizer: &ChatTokenizer, messages: &[(Role, &str)]) -> Vec<u32> {
    let mut all = vec![Message::new(Role::System, "You are a helpful assistant.")];
    all.extend(messages.iter().map(|(r, m)| Message::new(*r, *m)));
    tokenizer.encode(&chatml(&all, true)).unwrap()
}

#[test]
fn mlx_full_recompute_equals_candle_full_recompute() {
    let Some(l) = loaded() else { return };
    let mlx = MlxLlama::new(&l.weights).unwrap();
    assert_eq!(mlx.config(), &LlamaConfig::smollm2_135m());
    let candle = l.file.load(&Device::Cpu, WeightMode::F32, &mut |_| {}).unwrap();
    let ids = prompt(&l.tokenizer, &[(Role::User, "What is the capital of France?")]);
    let want = candle
        .forward_full(&ids, None)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let got = to_host(&mlx.forward_full(&ids).unwrap()).unwrap();
    let d = max_abs_diff(&got, &want);
    println!(
        "SmolLM2, {} tokens: mlx vs candle full recompute, max abs diff {d}",
        ids.len()
    );
    assert!(d <= TOL, "{d}");
}

#[test]
fn trie_schedule_equals_full_recompute() {
    let Some(l) = loaded() else { return };
    let model = MlxLlama::new(&l.weights).unwrap();
    let t = &l.tokenizer;
    // A budget of 48 positions: less than the conversations below hold, so
    // the trie evicts.
    let mut driver = Driver::new(&model, 256, 48 * bytes_per_position(&model));
    let (user, asst) = (Role::User, Role::Assistant);
    let a1 = prompt(t, &[(user, "Name a red fruit.")]);
    let b1 = prompt(t, &[(user, "What is 2 + 2?")]);
    let (a_held, a1_cached) = driver.request(&a1, 3);
    let (_, b1_cached) = driver.request(&b1, 3);
    // Back to conversation A, extended by a scripted reply and a new turn.
    let mut a2 = a_held.clone();
    a2.extend(
        t.encode("<|im_end|>\n<|im_start|>user\nAnother one?<|im_end|>\n<|im_start|>assistant\n")
            .unwrap(),
    );
    let (_, a2_cached) = driver.request(&a2, 3);
    // Conversation C branches off B's first message; then B continues.
    let c1 = prompt(t, &[(user, "What is 2 + 2?"), (asst, "4"), (user, "And 3 + 3?")]);
    let (_, c1_cached) = driver.request(&c1, 2);
    let (b_held, _) = driver.request(&b1, 2);
    let mut b2 = b_held;
    b2.extend(
        t.encode("<|im_end|>\n<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n")
            .unwrap(),
    );
    driver.request(&b2, 2);
    // A again, repeated exactly.
    let (_, a3_cached) = driver.request(&a2, 2);
    let stats = driver.stats();
    println!(
        "SmolLM2 through the trie on mlx: max abs diff {} over {} rows; {stats:?}",
        driver.max_diff, driver.rows
    );
    assert!(driver.max_diff <= TOL, "{} ({stats:?})", driver.max_diff);
    assert_eq!(a1_cached, 0);
    assert!(b1_cached > 0, "the shared system prompt is reused");
    assert!(c1_cached >= b1_cached, "C shares at least what B did");
    assert!(a2_cached > 0 && a3_cached > 0, "{a2_cached} {a3_cached}");
    assert!(stats.page_outs > 0 && stats.page_ins > 0, "{stats:?}");
    assert!(stats.evictions > 0, "{stats:?}");
}

#[test]
fn mlx_chat_answers_a_simple_question() {
    let Some(l) = loaded() else { return };
    let model = MlxLlama::new(&l.weights).unwrap();
    let mut chat = MlxChat::new(&model, Reuse::Trie, 1 << 30).unwrap();
    let ids = l.tokenizer.encode(&chatml(
        &[Message::new(Role::User, "What is the capital of France?")],
        true,
    ));
    let out = chat
        .generate(&ids.unwrap(), 12, Some(l.tokenizer.eos_token_id()))
        .unwrap();
    let text = l.tokenizer.decode(&out.generated).unwrap();
    assert!(text.contains("Paris"), "reply: {text:?}");
    assert_eq!((out.matched, out.evaluated), (0, out.prompt_tokens));
}
