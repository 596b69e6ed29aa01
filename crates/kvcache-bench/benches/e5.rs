//! Benchmark E5 (issue 12): multi-turn chat on a sliding-window model, Gemma 3
//! 270M (quantized weights, candle's quantized kernels, CPU) through the prefix
//! trie, a window-only cache and no reuse, over `fixtures/e5_trace.json`,
//! the policies alternating request by request.
//!
//! ```text
//! cargo xtask bench -p kvcache-bench --bench e5
//! ```
//!
//! Needs the Gemma file (`$KVCACHE_GEMMA`, which `cargo xtask` sets; skipped
//! with a printed reason without it). Knobs: `KVCACHE_E5_CONVERSATIONS`
//! (default 10: the first N conversations of the trace, the minimum computed
//! over them), `KVCACHE_E5_PREDICT` (default the trace's, 8),
//! `KVCACHE_E5_POLICIES` (default `trie,window,none`), `KVCACHE_E5_WEIGHTS`
//! (`quantized`, the default, or `f32`: the weights dequantized, candle's
//! dense kernels), `KVCACHE_E5_BUDGET_MIB` (the trie's snapshot budget,
//! default unlimited), `KVCACHE_E5_VERBOSE=1` (a line per request).

use candle_core::Device;
use kvcache_bench::e5::{self, E5Policy, E5Trace, E5Verdict};
use kvcache_bench::knobs::knob;
use kvcache_models::gemma::GemmaFile;
use kvcache_models::WeightMode;
use kvcache_testkit::models::{model_file, TestModel};

fn policy(name: &str) -> Option<E5Policy> {
    match name.trim() {
        "trie" => Some(E5Policy::Trie),
        "window" => Some(E5Policy::WindowOnly),
        "none" => Some(E5Policy::NoReuse),
        _ => None,
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // SAFETY: first thing in main, before any thread starts.
    unsafe { kvcache_models::threads::tune_cpu_threads() };
    // `cargo bench` passes `--bench`; a filter argument that is not ours skips.
    if std::env::args()
        .skip(1)
        .any(|a| !a.starts_with('-') && !"e5".contains(&a))
    {
        return Ok(());
    }
    let Some(path) = model_file(TestModel::Gemma3) else {
        return Ok(());
    };
    let full = E5Trace::load(e5::e5_trace_path())?;
    let conversations = knob("KVCACHE_E5_CONVERSATIONS", full.meta.n_conversations);
    let trace = full.first_conversations(conversations);
    let n_predict = knob("KVCACHE_E5_PREDICT", trace.meta.n_predict);
    let policies: Vec<E5Policy> = std::env::var("KVCACHE_E5_POLICIES")
        .unwrap_or_else(|_| "trie,window,none".into())
        .split(',')
        .map(|p| policy(p).ok_or_else(|| format!("unknown policy {p:?}")))
        .collect::<Result<_, _>>()?;
    let verbose = std::env::var("KVCACHE_E5_VERBOSE").is_ok_and(|v| v == "1");
    let budget = knob("KVCACHE_E5_BUDGET_MIB", usize::MAX >> 20) << 20;
    let weights = std::env::var("KVCACHE_E5_WEIGHTS").unwrap_or_else(|_| "quantized".into());
    let (mode, kernels) = match weights.as_str() {
        "quantized" => (WeightMode::Candle, "Q4_K_M weights, candle's quantized kernels"),
        "f32" => (
            WeightMode::F32,
            "Q4_K_M weights dequantized to f32, candle's dense kernels",
        ),
        other => return Err(format!("KVCACHE_E5_WEIGHTS={other:?}: quantized or f32").into()),
    };

    let device = Device::Cpu;
    let model = GemmaFile::open(&path)?.load(&device, mode, &mut |_| {})?;
    let c = model.config();
    println!(
        "E5: Gemma 3 270M ({kernels}, CPU, {} threads), window {}; trace {} conversations x {} turns, {} prompt tokens, minimum {}; {n_predict} tokens generated per request",
        candle_core::utils::get_num_threads(),
        c.window,
        trace.meta.n_conversations,
        trace.meta.n_turns,
        trace.meta.total_prompt_tokens,
        trace.meta.total_min_prefill,
    );
    let reports = e5::run(
        &model,
        &trace,
        &policies,
        n_predict,
        budget,
        &device,
        &mut |policy, row| {
            if verbose {
                println!(
                "  {:<12} #{:<3} conv {} turn {}: {:>5} prompt, evaluated {:>5} (min {:>4}), TTFT {:>6.0} ms",
                policy.name(),
                row.idx,
                row.conv,
                row.turn,
                row.prompt_tokens,
                row.evaluated,
                row.min_prefill,
                row.time_to_first_token.as_secs_f64() * 1e3
            );
            }
        },
    )?;
    for report in &reports {
        println!("{report}");
    }
    if let Some(verdict) = E5Verdict::from_reports(&reports) {
        println!("verdict: {verdict}");
    }
    Ok(())
}
