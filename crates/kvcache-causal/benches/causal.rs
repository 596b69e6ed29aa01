//! Workloads W1-W6 of the project's benchmark plan, exactly as the reference
//! (Ollama's Go `kvcache.Causal`) was measured: f32, one layer, head dim 8, one KV
//! head, max batch 512, padding 1, f32 mask. One op = `start_forward` +
//! `set_layer(0)` + `put` + `get` (keys, values and mask) unless stated otherwise.
//!
//! Prints, per workload, the median op time over several runs, the reference's
//! figure, the speed-up and the target. Also measures memset and memcpy bandwidth
//! in the same process so the mask build can be read as a fraction of it.
//!
//! Besides W1-W6: W1b (16 and 64 sequences decoding interleaved from 2,048 to
//! 4,096 tokens each, time per step at the start and at the end, which must stay
//! flat) and W2c (a new sequence prefilled from 0 to 8,192 in 512-token passes,
//! each pass a different mask: the prefill W2's repeated pass cannot show).
//!
//! `cargo xtask bench -p kvcache-causal --bench causal` (or `cargo bench -p kvcache-causal --bench causal`).
//! Set `KVCACHE_BENCH_RUNS` to change the number of runs (default 5; W1b makes
//! a third as many, at least one) and `KVCACHE_BENCH_ONLY` to a comma-separated
//! list of ids (`W1,W1b,W2,W2c,W3,W4,W5,W6,mem`) to run only those, and
//! `KVCACHE_BENCH_KV` to a storage type (`f16`, `bf16`, `q8_0`; f32 by default)
//! to store keys and values in (q8_0 with head dim 32, one block).
//! `KVCACHE_BENCH_VIEW` (`dense` or `paged`) says how an op reads the pass:
//! `get` (the reference's op) or `get_paged` (the runs a kernel walks, keys and
//! values as stored); paged by default for q8_0, dense otherwise.
//! `KVCACHE_DEVICE=cuda` (built with `--features cuda`) runs the caches on the
//! first NVIDIA GPU; every timed op then waits for the device to finish.

use std::hint::black_box;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use kvcache_api::{
    Batch, CausalCache, CausalConfig, ForwardMode, KeyShift, KvStorage, Placement, Pos, SlidingWindow,
};
use kvcache_causal::CausalKvCache;

/// The reference's head dim; q8_0 storage needs whole blocks of 32, so its runs
/// use one block.
fn head_dim() -> usize {
    match kv_storage() {
        KvStorage::Q8_0 => 32,
        _ => 8,
    }
}
const MAX_BATCH: usize = 512;

/// The device the caches live on: `KVCACHE_DEVICE` = `cpu` (default) or `cuda`.
fn device() -> &'static Device {
    static DEVICE: OnceLock<Device> = OnceLock::new();
    DEVICE.get_or_init(|| match std::env::var("KVCACHE_DEVICE").as_deref() {
        Err(_) | Ok("") | Ok("cpu") => Device::Cpu,
        Ok("cuda") => Device::new_cuda(0).expect("KVCACHE_DEVICE=cuda needs `--features cuda` and a GPU"),
        Ok(other) => panic!("KVCACHE_DEVICE must be cpu or cuda, not {other:?}"),
    })
}

/// Keys/values `[n, 1, head_dim()]`, made once per batch size outside the timing.
fn kv(n: usize) -> Tensor {
    Tensor::ones((n, 1, head_dim()), DType::F32, device()).expect("kv tensor")
}

fn identity_shift() -> Option<Box<dyn KeyShift<Tensor>>> {
    Some(Box::new(|_layer: usize, keys: &Tensor, _shifts: &[Pos]| {
        Ok(keys.clone())
    }))
}

/// The KV storage type the caches use: `KVCACHE_BENCH_KV` (`f32`, `f16`, `bf16`,
/// `q8_0`), f32 by default. Keys and values are put and got as f32 either way.
fn kv_storage() -> KvStorage {
    std::env::var("KVCACHE_BENCH_KV")
        .ok()
        .map(|name| name.parse().expect("KVCACHE_BENCH_KV names a storage type"))
        .unwrap_or(KvStorage::F32)
}

fn cache(config: CausalConfig) -> CausalKvCache {
    let config = config.with_kv_storage(kv_storage());
    CausalKvCache::new(config, device().clone(), identity_shift()).expect("cache")
}

/// How an op reads what the pass attends to: `get` (keys and values of the
/// pass's range in the compute dtype, and the dense mask) or `get_paged` (each
/// row's runs of cells, keys and values as stored).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum View {
    Dense,
    Paged,
}

/// `KVCACHE_BENCH_VIEW` (`dense`, `paged`); by default the paged view for
/// `q8_0` storage (what a kernel reads: decoding the range is what `get` costs
/// there) and the dense one otherwise (the reference's op).
fn view() -> View {
    static VIEW: OnceLock<View> = OnceLock::new();
    *VIEW.get_or_init(|| match std::env::var("KVCACHE_BENCH_VIEW").as_deref() {
        Ok("dense") => View::Dense,
        Ok("paged") => View::Paged,
        Err(_) | Ok("") if kv_storage() == KvStorage::Q8_0 => View::Paged,
        Err(_) | Ok("") => View::Dense,
        Ok(other) => panic!("KVCACHE_BENCH_VIEW must be dense or paged, not {other:?}"),
    })
}

/// One op as the reference timed it (the read as [`view`] says).
fn op(cache: &mut CausalKvCache, batch: &Batch, kv: &Tensor) {
    cache
        .start_forward(batch, ForwardMode::Compute)
        .expect("start_forward");
    cache.set_layer(0);
    cache.put(kv, kv).expect("put");
    match view() {
        View::Dense => drop(black_box(cache.get().expect("get"))),
        View::Paged => drop(black_box(cache.get_paged().expect("get_paged"))),
    }
}

fn prefill(cache: &mut CausalKvCache, seq: usize, tokens: usize) {
    let kv = kv(MAX_BATCH);
    for start in (0..tokens).step_by(MAX_BATCH) {
        let batch = Batch::sequence(seq, start as Pos, MAX_BATCH).expect("batch");
        op(cache, &batch, &kv);
    }
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

struct Row {
    id: &'static str,
    what: String,
    ours: Duration,
    reference_ms: f64,
    target_ms: f64,
    stretch_ms: Option<f64>,
}

/// Runs `setup` then times `body` `ops` times per run, for `runs` runs, and
/// returns the median of the per-run medians.
fn measure<S, F>(runs: usize, ops: usize, mut setup: impl FnMut() -> S, mut body: F) -> Duration
where
    F: FnMut(&mut S, usize) -> Duration,
{
    let mut per_run = Vec::with_capacity(runs);
    for _ in 0..runs {
        let mut state = setup();
        let times: Vec<Duration> = (0..ops).map(|i| body(&mut state, i)).collect();
        per_run.push(median(times));
    }
    median(per_run)
}

/// Wall time of `f`, including the device work it queued.
fn timed(f: impl FnOnce()) -> Duration {
    let start = Instant::now();
    f();
    device().synchronize().expect("device synchronize");
    start.elapsed()
}

fn w1(runs: usize) -> (Row, Duration, usize) {
    let setup = || {
        let mut c = cache(CausalConfig::new(16, 4096, MAX_BATCH));
        for seq in 0..16 {
            prefill(&mut c, seq, 2048);
        }
        (c, kv(16))
    };
    let mut mask_bytes = 0;
    let batch_at = |k: usize| Batch::from_tokens((0..16).map(|i| (i, 2048 + k as Pos))).expect("batch");
    let ours = measure(runs, 200, setup, |(c, kv), k| {
        let batch = batch_at(k);
        let t = timed(|| op(c, &batch, kv));
        mask_bytes = c.get().expect("get").mask.elem_count() * 4;
        t
    });
    // The mask build alone: start_forward on the same state.
    let sf = measure(
        runs,
        200,
        || {
            let mut c = cache(CausalConfig::new(16, 4096, MAX_BATCH));
            for seq in 0..16 {
                prefill(&mut c, seq, 2048);
            }
            c
        },
        |c, k| {
            let batch = batch_at(k);
            let t = timed(|| {
                c.start_forward(&batch, ForwardMode::Compute)
                    .expect("start_forward")
            });
            // Keep the cache consistent for the next step.
            c.set_layer(0);
            c.put(&kv(16), &kv(16)).expect("put");
            t
        },
    );
    let row = Row {
        id: "W1 decode",
        what: "16 seqs x 4096 cells each, 2048 prefilled, op = 16 tokens (one per sequence)".into(),
        ours,
        // The reference's median over the same 200 steps (pos 2048..2247); its
        // 2.79 ms is the median over the whole decode to 4096 (see W1b).
        reference_ms: 1.9,
        target_ms: 0.19,
        stretch_ms: Some(0.063),
    };
    (row, sf, mask_bytes)
}

fn w2(runs: usize) -> (Row, Row, Duration, usize) {
    let setup = || {
        let mut c = cache(CausalConfig::new(1, 32768, MAX_BATCH));
        prefill(&mut c, 0, 8192);
        (
            c,
            kv(MAX_BATCH),
            Batch::sequence(0, 8192, MAX_BATCH).expect("batch"),
        )
    };
    let mut mask_bytes = 0;
    let ours = measure(runs, 30, setup, |(c, kv, batch), _| {
        let t = timed(|| op(c, batch, kv));
        mask_bytes = c.get().expect("get").mask.elem_count() * 4;
        c.remove(0, (8192..).into()).expect("remove");
        t
    });
    let remove = measure(runs, 30, setup, |(c, kv, batch), _| {
        op(c, batch, kv);
        timed(|| c.remove(0, (8192..).into()).expect("remove"))
    });
    let sf = measure(runs, 30, setup, |(c, kv, batch), _| {
        let t = timed(|| {
            c.start_forward(batch, ForwardMode::Compute)
                .expect("start_forward")
        });
        c.set_layer(0);
        c.put(kv, kv).expect("put");
        c.remove(0, (8192..).into()).expect("remove");
        t
    });
    let prefill_row = Row {
        id: "W2 prefill",
        what: "1 seq, 8192 cached, op = 512 tokens at 8192..8703 (mask 512 x 8704)".into(),
        ours,
        reference_ms: 15.1,
        target_ms: 1.5,
        stretch_ms: None,
    };
    let remove_row = Row {
        id: "W2r remove",
        what: "remove(0, 8192..) after a W2 op".into(),
        ours: remove,
        reference_ms: 0.066,
        target_ms: 0.0066,
        stretch_ms: None,
    };
    (prefill_row, remove_row, sf, mask_bytes)
}

/// W2c: a new sequence prefilled from 0 to 8,192 in 512-token passes, each pass a
/// different mask (`512 x 512 (i + 1)`); the op is one pass, the median is over
/// the 16 passes of a fresh cache.
fn w2c(runs: usize) -> Row {
    let kv = kv(MAX_BATCH);
    let ours = measure(
        runs,
        16,
        || cache(CausalConfig::new(1, 32768, MAX_BATCH)),
        |c, i| {
            let batch = Batch::sequence(0, (i * MAX_BATCH) as Pos, MAX_BATCH).expect("batch");
            timed(|| op(c, &batch, &kv))
        },
    );
    Row {
        id: "W2c chunked prefill",
        what: "1 seq, fresh, op i = 512 tokens at 512i (mask 512 x 512(i+1)), i = 0..15".into(),
        ours,
        reference_ms: 8.4,
        target_ms: 0.84,
        stretch_ms: None,
    }
}

/// Steps timed at each end of W1b's decode.
const W1B_WINDOW: usize = 100;

/// W1b with `n` sequences: prefilled to 2,048 one after another (as W1), then
/// decoding interleaved to 4,096, one token per sequence per step. Returns the
/// median step time over the first and the last [`W1B_WINDOW`] steps and over
/// all 2,048, each the median over runs.
fn w1b(runs: usize, n: usize) -> (Duration, Duration, Duration) {
    let (mut start, mut end, mut all) = (vec![], vec![], vec![]);
    for _ in 0..runs {
        let mut c = cache(CausalConfig::new(n, 4096, MAX_BATCH));
        for seq in 0..n {
            prefill(&mut c, seq, 2048);
        }
        let kv = kv(n);
        let steps: Vec<Duration> = (0..2048)
            .map(|k| {
                let batch = Batch::from_tokens((0..n).map(|i| (i, 2048 + k as Pos))).expect("batch");
                timed(|| op(&mut c, &batch, &kv))
            })
            .collect();
        start.push(median(steps[..W1B_WINDOW].to_vec()));
        end.push(median(steps[steps.len() - W1B_WINDOW..].to_vec()));
        all.push(median(steps));
    }
    (median(start), median(end), median(all))
}

fn print_w1b(runs: usize) {
    println!("\nW1b: n sequences x 4096 cells each, prefilled to 2048, decoding interleaved to 4096;");
    println!(
        "op = n tokens (one per sequence); median over the first / last {W1B_WINDOW} steps and all 2048\n"
    );
    println!("| n | first {W1B_WINDOW} (ms) | last {W1B_WINDOW} (ms) | end / start | all 2048 (ms) |");
    println!("|---|---|---|---|---|");
    for n in [16, 64] {
        let (start, end, all) = w1b(runs, n);
        println!(
            "| {n} | {:.4} | {:.4} | {:.2}x | {:.4} |",
            ms(start),
            ms(end),
            end.as_secs_f64() / start.as_secs_f64(),
            ms(all)
        );
    }
    println!("(reference, n = 16: 2.79 ms over all 2048 steps, about 1.9 ms over the first 200)");
}

/// W2's `start_forward` as the first pass of a new cache big enough to need a new
/// mask buffer (the prefill's masks were smaller), so the whole mask is written
/// into new memory.
fn w2_first_pass(runs: usize) -> Duration {
    let setup = || {
        let mut c = cache(CausalConfig::new(1, 32768, MAX_BATCH));
        prefill(&mut c, 0, 8192);
        c
    };
    let batch = Batch::sequence(0, 8192, MAX_BATCH).expect("batch");
    measure(runs * 3, 1, setup, |c, _| {
        timed(|| {
            c.start_forward(&batch, ForwardMode::Compute)
                .expect("start_forward")
        })
    })
}

fn w3(runs: usize) -> Row {
    let setup = || {
        let config = CausalConfig::new(16, 32768, MAX_BATCH).with_window(SlidingWindow::from_ollama(4096));
        assert_eq!(config.num_cells(), 66064);
        let mut c = cache(config);
        for seq in 0..16 {
            prefill(&mut c, seq, 8192);
        }
        (c, kv(16))
    };
    let ours = measure(runs, 100, setup, |(c, kv), k| {
        let batch = Batch::from_tokens((0..16).map(|i| (i, 8192 + k as Pos))).expect("batch");
        timed(|| op(c, &batch, kv))
    });
    Row {
        id: "W3 SWA decode",
        what: "window 4097, 16 seqs, 66064 cells, 8192 prefilled each, op = 16 tokens".into(),
        ours,
        reference_ms: 5.88,
        target_ms: 0.59,
        stretch_ms: Some(0.2),
    }
}

fn w4(runs: usize) -> Row {
    let setup = || {
        let mut c = cache(CausalConfig::new(16, 4096, MAX_BATCH));
        prefill(&mut c, 0, 4096);
        c
    };
    let ours = measure(runs, 300, setup, |c, i| {
        timed(|| c.copy_prefix(0, 1 + i % 15, 4096).expect("copy_prefix"))
    });
    Row {
        id: "W4 copy prefix",
        what: "seq 0 holds 4096 tokens, op i = copy_prefix(0, 1 + i % 15, 4096)".into(),
        ours,
        reference_ms: 0.283,
        target_ms: 0.028,
        stretch_ms: None,
    }
}

fn w5(runs: usize) -> Row {
    let mut base = cache(CausalConfig::new(1, 8192, MAX_BATCH));
    prefill(&mut base, 0, 8192);
    let ours = measure(
        runs,
        50,
        || base.try_clone().expect("clone"),
        |c, _| {
            c.try_clone_from(&base).expect("restore");
            timed(|| c.remove(0, (100..200).into()).expect("remove"))
        },
    );
    Row {
        id: "W5 remove + shift",
        what: "1 seq, 8192 tokens, op = remove(0, 100..200) with an identity shift, fresh state".into(),
        ours,
        reference_ms: 0.065,
        target_ms: 0.0065,
        stretch_ms: None,
    }
}

fn w6(runs: usize) -> Row {
    let config = CausalConfig::new(1, 8192, MAX_BATCH).with_placement(Placement::Contiguous);
    let mut base = cache(config);
    prefill(&mut base, 0, 8192);
    for j in (0..32).rev() {
        base.remove(0, (128 * j..128 * j + 64).into()).expect("remove");
    }
    let batch = Batch::sequence(0, 6144, MAX_BATCH).expect("batch");
    let kv = kv(MAX_BATCH);
    let ours = measure(
        runs,
        20,
        || base.try_clone().expect("clone"),
        |c, _| {
            c.try_clone_from(&base).expect("restore");
            timed(|| op(c, &batch, &kv))
        },
    );
    Row {
        id: "W6 defrag",
        what: "8192 cells, 32 holes of 64, op = 512 tokens at 6144.. needing compaction".into(),
        ours,
        reference_ms: 12.7,
        target_ms: 1.3,
        stretch_ms: None,
    }
}

/// GB/s of filling a buffer of `bytes` with a constant, and of copying one.
fn bandwidth(bytes: usize, runs: usize) -> (f64, f64) {
    let n = bytes / 4;
    let mut dst = vec![0f32; n];
    let src = vec![1f32; n];
    let fill = median(
        (0..runs * 4)
            .map(|_| {
                timed(|| {
                    dst.fill(f32::NEG_INFINITY);
                    black_box(&mut dst);
                })
            })
            .collect(),
    );
    let copy = median(
        (0..runs * 4)
            .map(|_| {
                timed(|| {
                    dst.copy_from_slice(&src);
                    black_box(&mut dst);
                })
            })
            .collect(),
    );
    let gbs = |d: Duration| bytes as f64 / d.as_secs_f64() / 1e9;
    (gbs(fill), gbs(copy))
}

/// A workload measured over the given number of runs.
type Workload = fn(usize) -> Row;

/// Whether workload `id` is selected by `KVCACHE_BENCH_ONLY` (all when unset).
fn selected(id: &str) -> bool {
    match std::env::var("KVCACHE_BENCH_ONLY") {
        Ok(only) => only.split(',').any(|x| x.trim().eq_ignore_ascii_case(id)),
        Err(_) => true,
    }
}

fn print_rows(rows: &[Row]) {
    println!("| id | workload | ours (ms) | reference (ms) | speed-up | target (ms) | meets |");
    println!("|---|---|---|---|---|---|---|");
    for r in rows {
        let ours = ms(r.ours);
        let meets = if r.stretch_ms.is_some_and(|s| ours <= s) {
            "yes (stretch)"
        } else if ours <= r.target_ms {
            "yes"
        } else {
            "NO"
        };
        println!(
            "| {} | {} | {:.4} | {} | {:.1}x | {} | {} |",
            r.id,
            r.what,
            ours,
            r.reference_ms,
            r.reference_ms / ours,
            r.target_ms,
            meets
        );
    }
}

fn main() {
    // `cargo bench` passes `--bench`; ignore arguments.
    let runs: usize = std::env::var("KVCACHE_BENCH_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    println!(
        "kvcache-causal W1-W6: f32 in and out, {} storage, 1 layer, head dim {}, 1 KV head, max batch {MAX_BATCH},",
        kv_storage(),
        head_dim()
    );
    println!(
        "padding 1, f32 mask, {:?}, {:?} view; median over {runs} runs of per-run medians\n",
        device().location(),
        view()
    );

    let mut rows = Vec::new();
    let mut builds = Vec::new();
    if selected("W1") {
        let (r1, w1_sf, w1_mask) = w1(runs);
        rows.push(r1);
        builds.push(("W1", w1_sf, w1_mask));
    }
    if selected("W2") {
        let (r2, r2r, w2_sf, w2_mask) = w2(runs);
        rows.extend([r2, r2r]);
        builds.push(("W2", w2_sf, w2_mask));
    }
    let more: [(&str, Workload); 5] = [("W2c", w2c), ("W3", w3), ("W4", w4), ("W5", w5), ("W6", w6)];
    for (id, bench) in more {
        if selected(id) {
            rows.push(bench(runs));
        }
    }
    print_rows(&rows);

    if selected("W1b") {
        print_w1b((runs / 3).max(1));
    }

    if !selected("mem") {
        return;
    }
    println!("\nMask build vs memory bandwidth (same process):");
    let small = builds.iter().map(|b| b.2).next().unwrap_or(0);
    let (fill_small, copy_small) = bandwidth(small.max(4 << 20), runs);
    let (fill_big, copy_big) = bandwidth(64 << 20, runs);
    println!(
        "  fill {:.1} MB: {fill_small:.1} GB/s; copy: {copy_small:.1} GB/s",
        small.max(4 << 20) as f64 / 1e6
    );
    println!("  fill 64 MB: {fill_big:.1} GB/s; copy 64 MB: {copy_big:.1} GB/s");
    if let Some(&(_, _, w2_mask)) = builds.iter().find(|b| b.0 == "W2") {
        builds.push(("W2 first pass", w2_first_pass(runs), w2_mask));
    }
    for (id, sf, bytes) in builds {
        let gbs = bytes as f64 / sf.as_secs_f64() / 1e9;
        println!(
            "  {id}: start_forward (placement + mask of {:.1} MB) {:.4} ms = {gbs:.1} GB/s = {:.0}% of 64 MB memcpy",
            bytes as f64 / 1e6,
            ms(sf),
            100.0 * gbs / copy_big
        );
    }
}
