//! `paged_attention` against a plain f64 attention over `get()`'s keys, values
//! and dense mask, after every pass of random schedules on a `CausalKvCache`:
//! several sequences, batches mixing prefill and decode, sliding windows with
//! memory, chunked attention, `copy_prefix`, removals with and without a key
//! shift, compaction and contiguous placement, both value layouts and every
//! storage type. Also: `get_paged`'s runs are exactly the mask's visible cells,
//! and the kernel reads strided tensors, rows that see nothing and bad shapes
//! as documented.

use std::iter::once;

use candle_core::{DType as CandleDType, Device, Tensor};
use kvcache_api::{
    Batch, CacheError, CausalCache, CausalConfig, DType, ForwardMode, KvStorage, PagedKv, Placement, Pos,
    PosRange, RowRuns, SeqId, SlidingWindow, StoredKv, VLayout,
};
use kvcache_causal::{key_shift, CausalKvCache};
use kvcache_models::attention::device::PagedLaunch;
use kvcache_models::attention::paged_attention;
use kvcache_models::ModelError;

mod cuda_on_cpu;

const LAYERS: usize = 2;
const TOL: f64 = 1e-4;

/// A small deterministic generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Uniform in `[-2, 2)`.
    fn sym(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
    }

    fn tensor(&mut self, shape: &[usize]) -> Tensor {
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| self.sym()).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }
}

/// One cache layout under test.
#[derive(Debug, Clone)]
struct Case {
    config: CausalConfig,
    kv_heads: usize,
    heads: usize,
    head_dim: usize,
    /// Longest prefill chunk of one sequence in a pass.
    chunk: usize,
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_dtype(CandleDType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// Attention in f64 over `get()`'s keys and values under its dense mask:
/// `[n, heads * head_dim_v]`, rows that see nothing zero.
#[allow(clippy::too_many_arguments)]
fn reference(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    mask: &[f32],
    (n, heads, kvh, hd, hdv, cells): (usize, usize, usize, usize, usize, usize),
    permuted: bool,
    scale: f64,
) -> Vec<f64> {
    let g = heads / kvh;
    let mut out = vec![0f64; n * heads * hdv];
    for r in 0..n {
        for h in 0..heads {
            let j = h / g;
            let qh = &q[(r * heads + h) * hd..][..hd];
            let visible: Vec<usize> = (0..cells).filter(|&c| mask[r * cells + c] == 0.0).collect();
            if visible.is_empty() {
                continue;
            }
            let scores: Vec<f64> = visible
                .iter()
                .map(|&c| {
                    let k = &keys[(c * kvh + j) * hd..][..hd];
                    qh.iter()
                        .zip(k)
                        .map(|(&a, &b)| f64::from(a) * f64::from(b))
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            for (&c, &p) in visible.iter().zip(&e) {
                for d in 0..hdv {
                    let v = if permuted {
                        values[(j * hdv + d) * cells + c]
                    } else {
                        values[(c * kvh + j) * hdv + d]
                    };
                    out[(r * heads + h) * hdv + d] += p / sum * f64::from(v);
                }
            }
        }
    }
    out
}

/// What one comparison saw.
#[derive(Debug, Default)]
struct Seen {
    passes: usize,
    rows: usize,
    max_diff: f64,
    /// Rows whose runs were not one contiguous run.
    split_rows: usize,
    /// Rows seeing more than one tile.
    long_rows: usize,
    /// Prefix copies and shifting removals done.
    copies: usize,
    shifts: usize,
    /// Launches of the CUDA kernel run on the CPU and checked.
    emulated: usize,
}

/// Launches of the CUDA kernel recorded during a schedule, with what each must
/// give: the dense reference and the CPU kernel's output.
#[derive(Default)]
struct Emulated {
    launches: cuda_on_cpu::Launches,
    want: Vec<Vec<f64>>,
    cpu: Vec<Vec<f32>>,
}

/// Puts random keys and values for every layer of the pass in progress and
/// compares `paged_attention` with the reference on each layer.
/// With `emulated`, also records the CUDA kernel's launch for each layer.
fn check_pass(
    cache: &mut CausalKvCache,
    case: &Case,
    n: usize,
    rng: &mut Rng,
    seen: &mut Seen,
    mut emulated: Option<&mut Emulated>,
) {
    let (kvh, heads, hd) = (case.kv_heads, case.heads, case.head_dim);
    let permuted = case.config.v_layout == VLayout::Permuted;
    let scale = 1.0 / (hd as f64).sqrt();
    let range = cache.pass_range().expect("a pass in progress");
    let device = cache.device().clone();
    let on_device = |t: Tensor| t.to_device(&device).unwrap();
    for layer in 0..LAYERS {
        cache.set_layer(layer);
        cache
            .put(
                &on_device(rng.tensor(&[n, kvh, hd])),
                &on_device(rng.tensor(&[n, kvh, hd])),
            )
            .unwrap();
        let q = on_device(rng.tensor(&[n, heads, hd]));
        let view = cache.get().unwrap();
        let cells = range.len();
        let mask = f32s(&view.mask);
        assert_eq!(mask.len() % cells.max(1), 0);
        let paged = cache.get_paged().unwrap();
        assert_eq!(paged.v_layout, case.config.v_layout);
        // The runs are the mask's visible cells, row by row.
        assert_eq!(paged.runs.rows(), n);
        for r in 0..n {
            let from_runs: Vec<usize> = paged.runs.row(r).iter().flat_map(|c| c.cells()).collect();
            let from_mask: Vec<usize> = (0..cells)
                .filter(|&c| mask[r * cells + c] == 0.0)
                .map(|c| range.start + c)
                .collect();
            assert_eq!(from_runs, from_mask, "row {r} of {n}, range {range:?}");
            assert!(!from_runs.is_empty(), "a token sees itself");
            seen.split_rows += usize::from(paged.runs.row(r).len() > 1);
            seen.long_rows += usize::from(from_runs.len() > 64);
        }
        let got = paged_kernel(&q, &paged, scale as f32);
        assert_eq!(got.dims(), &[n, heads * hd]);
        let want = reference(
            &f32s(&q),
            &f32s(&view.keys),
            &f32s(&view.values),
            &mask,
            (n, heads, kvh, hd, hd, cells),
            permuted,
            scale,
        );
        let diff = f32s(&got)
            .iter()
            .zip(&want)
            .map(|(&a, &b)| (f64::from(a) - b).abs())
            .fold(0f64, f64::max);
        assert!(
            diff <= TOL,
            "{case:?}: paged vs reference {diff} (layer {layer}, {n} rows)"
        );
        seen.max_diff = seen.max_diff.max(diff);
        seen.rows += n;
        if let Some(e) = emulated.as_deref_mut() {
            let launch = PagedLaunch::new(&q, &paged, scale as f32)
                .unwrap()
                .expect("the kernel takes every case");
            e.launches.push(&launch, &q, &paged);
            e.want.push(want);
            e.cpu.push(f32s(&got));
        }
    }
    seen.passes += 1;
}

/// The paged kernel of the device `q` lives on.
fn paged_kernel(q: &Tensor, view: &PagedKv<'_, Tensor>, scale: f32) -> Tensor {
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        return kvcache_models::attention::device::paged_attention_cuda(q, view, scale)
            .unwrap()
            .expect("the CUDA kernel takes every case");
    }
    paged_attention(q, view, scale)
        .unwrap()
        .expect("the CPU kernel takes CPU tensors")
}

/// A key shift that moves each key by a small multiple of its delta.
fn shift() -> Box<dyn kvcache_api::KeyShift<Tensor>> {
    key_shift(|_layer, keys, shifts| {
        let deltas: Vec<f32> = shifts.iter().map(|&s| s as f32 * 0.01).collect();
        let deltas = Tensor::from_vec(deltas, (shifts.len(), 1, 1), keys.device())
            .and_then(|d| d.to_dtype(keys.dtype()))
            .map_err(CacheError::backend)?;
        keys.broadcast_add(&deltas).map_err(CacheError::backend)
    })
}

/// Runs `ops` random operations on a cache of `case`, checking every pass;
/// with `harness`, the CUDA kernel's launches too, run on the CPU at the end.
fn run(case: &Case, seed: u64, ops: usize, harness: Option<&std::path::Path>) -> Seen {
    run_on(&Device::Cpu, case, seed, ops, harness)
}

/// [`run`] with the cache on `device`.
fn run_on(device: &Device, case: &Case, seed: u64, ops: usize, harness: Option<&std::path::Path>) -> Seen {
    let mut rng = Rng(seed);
    let mut cache = CausalKvCache::new(case.config.clone(), device.clone(), Some(shift())).unwrap();
    let seqs = case.config.max_sequences;
    let capacity = case.config.capacity as Pos;
    let mut seen = Seen::default();
    let mut emulated = harness.map(|_| Emulated::default());
    let next = |cache: &CausalKvCache, s: SeqId| cache.positions(s).last().map_or(0, |p| p.0 + 1);
    for _ in 0..ops {
        match rng.below(10) {
            0..=5 => {
                // A pass: some sequences decode one token, others prefill a chunk.
                let mut lists: Vec<Vec<(SeqId, Pos)>> = Vec::new();
                let mut total = 0;
                for s in 0..seqs {
                    if rng.below(3) == 0 {
                        continue;
                    }
                    let start = next(&cache, s);
                    let want = if rng.below(2) == 0 {
                        1
                    } else {
                        1 + rng.below(case.chunk)
                    };
                    let len = want
                        .min((capacity - start).max(0) as usize)
                        .min(case.config.max_batch - total);
                    if len == 0 {
                        continue;
                    }
                    total += len;
                    lists.push((start..start + len as Pos).map(|p| (s, p)).collect());
                }
                if total == 0 {
                    continue;
                }
                // Interleave the sequences' tokens, or keep each chunk whole.
                let tokens: Vec<(SeqId, Pos)> = if rng.below(2) == 0 {
                    let longest = lists.iter().map(Vec::len).max().unwrap_or(0);
                    (0..longest)
                        .flat_map(|i| lists.iter().filter_map(move |l| l.get(i).copied()))
                        .collect()
                } else {
                    lists.concat()
                };
                let batch = Batch::from_tokens(tokens.iter().copied()).unwrap();
                match cache.start_forward(&batch, ForwardMode::Compute) {
                    Ok(()) => check_pass(
                        &mut cache,
                        case,
                        tokens.len(),
                        &mut rng,
                        &mut seen,
                        emulated.as_mut(),
                    ),
                    Err(CacheError::Full { .. }) => {
                        let s = rng.below(seqs);
                        cache.remove(s, PosRange::from(..)).unwrap();
                    }
                    Err(e) => panic!("{case:?}: {e}"),
                }
            }
            6 => {
                let (src, dst) = (rng.below(seqs), rng.below(seqs));
                let len = rng.below(next(&cache, src) as usize + 1) as Pos;
                if src != dst && len > 0 && cache.copy_prefix(src, dst, len).is_ok() {
                    seen.copies += 1;
                }
            }
            7 => {
                // Truncate, or leave.
                let s = rng.below(seqs);
                let keep = rng.below(next(&cache, s) as usize + 1) as Pos;
                cache.remove(s, PosRange::from(keep..)).unwrap();
            }
            _ => {
                // Remove a middle range, shifting the later positions down
                // (refused where cells are shared).
                let s = rng.below(seqs);
                let len = next(&cache, s);
                if len > 2 {
                    let a = rng.below(len as usize - 1) as Pos;
                    let b = a + 1 + rng.below((len - a) as usize - 1) as Pos;
                    match cache.remove(s, PosRange::from(a..b)) {
                        Ok(()) => seen.shifts += 1,
                        Err(CacheError::SharedCellShift { .. }) => {}
                        Err(e) => panic!("{case:?}: {e}"),
                    }
                }
            }
        }
    }
    cache.check();
    if let (Some(harness), Some(e)) = (harness, emulated) {
        let outputs = e.launches.run(harness);
        for (i, out) in outputs.iter().enumerate() {
            let diff = |other: &mut dyn Iterator<Item = f64>| {
                out.iter()
                    .zip(other)
                    .map(|(&a, b)| (f64::from(a) - b).abs())
                    .fold(0f64, f64::max)
            };
            let vs_reference = diff(&mut e.want[i].iter().copied());
            let vs_cpu = diff(&mut e.cpu[i].iter().map(|&x| f64::from(x)));
            assert!(
                vs_reference <= TOL && vs_cpu <= TOL,
                "{case:?}: launch {i}: the CUDA kernel vs the reference {vs_reference}, vs the CPU kernel {vs_cpu}"
            );
            seen.max_diff = seen.max_diff.max(vs_reference);
        }
        seen.emulated += outputs.len();
    }
    seen
}

fn cases() -> Vec<Case> {
    let base = |seqs, capacity, batch| CausalConfig::new(seqs, capacity, batch);
    let case = |config: CausalConfig, head_dim: usize, chunk: usize| Case {
        config,
        kv_heads: 2,
        heads: 6,
        head_dim,
        chunk,
    };
    let mut cases = Vec::new();
    for storage in KvStorage::ALL {
        for layout in [VLayout::Normal, VLayout::Permuted] {
            let hd = if storage == KvStorage::Q8_0 { 32 } else { 16 };
            let with = |c: CausalConfig| c.with_kv_storage(storage).with_v_layout(layout);
            // Full attention, scattered placement.
            cases.push(case(with(base(4, 48, 16)), hd, 8));
            // Sliding window with memory, padded masks in f16.
            cases.push(case(
                with(base(3, 64, 12))
                    .with_window(SlidingWindow::with_memory(6, 10))
                    .with_padding(4, 8)
                    .with_mask_dtype(DType::F16),
                hd,
                6,
            ));
            // Chunked attention.
            cases.push(case(with(base(3, 40, 12)).with_chunk_size(5), hd, 7));
            // Contiguous placement, compaction threshold.
            cases.push(case(
                with(base(4, 40, 16))
                    .with_placement(Placement::Contiguous)
                    .with_compact_threshold(Some(0.25)),
                hd,
                6,
            ));
        }
        // Long prefills: more than 16 rows a block and 64 cells a tile.
        let hd = if storage == KvStorage::Q8_0 { 64 } else { 32 };
        cases.push(case(base(2, 200, 48).with_kv_storage(storage), hd, 40));
        // Model-sized heads: 64 dimensions (the kernel's register-held chunk of
        // the output), four query heads a key/value head (in pairs).
        cases.push(Case {
            heads: 8,
            head_dim: 64,
            ..case(base(3, 160, 40).with_kv_storage(storage), 64, 24)
        });
    }
    cases
}

#[test]
fn paged_attention_equals_the_dense_reference_on_random_schedules() {
    let mut total = Seen::default();
    for (i, case) in cases().iter().enumerate() {
        for seed in 0..3u64 {
            let seen = run(case, 1000 * i as u64 + seed, 60, None);
            assert!(seen.passes >= 5, "{case:?}: only {} passes", seen.passes);
            total.passes += seen.passes;
            total.rows += seen.rows;
            total.split_rows += seen.split_rows;
            total.long_rows += seen.long_rows;
            total.copies += seen.copies;
            total.shifts += seen.shifts;
            total.max_diff = total.max_diff.max(seen.max_diff);
        }
    }
    eprintln!("{total:?}");
    // The schedules reached what they are meant to cover.
    assert!(total.split_rows > 100, "{total:?}");
    assert!(total.long_rows > 50, "{total:?}");
    assert!(total.copies > 100 && total.shifts > 100, "{total:?}");
    assert!(total.max_diff <= TOL, "{total:?}");
}

/// The CUDA kernel's source, run on the CPU through the shim: every case's
/// schedule in every storage type, checked launch by launch against the dense
/// reference and the CPU kernel. Blocks of 32 threads (tiles of 32 cells, so
/// the online softmax rescales often) for all cases, and of 128 (what the GPU
/// runs) for the long prefills.
#[test]
fn the_cuda_kernel_run_on_the_cpu_equals_the_dense_reference() {
    let (Some(small), Some(full)) = (cuda_on_cpu::harness(32), cuda_on_cpu::harness(128)) else {
        return;
    };
    let mut total = Seen::default();
    for (i, case) in cases().iter().enumerate() {
        let long = case.chunk > 16;
        let seen = run(case, 7_000 + i as u64, 16, Some(small));
        total.emulated += seen.emulated;
        total.long_rows += seen.long_rows;
        total.split_rows += seen.split_rows;
        total.max_diff = total.max_diff.max(seen.max_diff);
        if long {
            let seen = run(case, 9_000 + i as u64, 16, Some(full));
            total.emulated += seen.emulated;
            total.long_rows += seen.long_rows;
        }
    }
    eprintln!("{total:?}");
    assert!(total.emulated > 300, "{total:?}");
    assert!(total.long_rows > 20 && total.split_rows > 30, "{total:?}");
    assert!(total.max_diff <= TOL, "{total:?}");
}

/// On the GPU (`cargo xtask test-cuda` sets `KVCACHE_DEVICE=cuda`): the same
/// schedules with the cache on the device, the CUDA kernel against the dense
/// reference after every pass. Elsewhere it says it skipped: the kernel's
/// logic is checked on the CPU by the test above.
#[cfg(feature = "cuda")]
#[test]
fn the_cuda_kernel_on_the_gpu_equals_the_dense_reference() {
    if std::env::var("KVCACHE_DEVICE").as_deref() != Ok("cuda") {
        eprintln!("skipped: KVCACHE_DEVICE is not cuda");
        return;
    }
    let device = Device::new_cuda(0).expect("KVCACHE_DEVICE=cuda needs a GPU");
    let mut total = Seen::default();
    for (i, case) in cases().iter().enumerate() {
        let seen = run_on(&device, case, 5_000 + i as u64, 40, None);
        total.passes += seen.passes;
        total.long_rows += seen.long_rows;
        total.max_diff = total.max_diff.max(seen.max_diff);
    }
    eprintln!("{total:?}");
    assert!(total.passes > 200 && total.long_rows > 20, "{total:?}");
    assert!(total.max_diff <= TOL, "{total:?}");
}

/// A whole-layer view built by hand: keys and values as `Float` tensors.
fn view<'a>(keys: Tensor, values: Tensor, v_layout: VLayout, runs: &'a RowRuns) -> PagedKv<'a, Tensor> {
    PagedKv {
        keys: StoredKv::Float(keys),
        values: StoredKv::Float(values),
        v_layout,
        runs,
    }
}

#[test]
fn strided_tensors_are_read_through_their_layout() {
    let mut rng = Rng(7);
    let (cells, kvh, heads, hd) = (80, 2, 4, 8);
    let mut runs = RowRuns::default();
    runs.push_row([0..3, 10..75]);
    runs.push_row(once(5..6));
    runs.push_row([]); // sees nothing: zeros
    runs.push_row(once(2..80));
    let n = runs.rows();
    // Keys a narrowed slice of a wider tensor (a start offset and a cell stride
    // of 3 heads), values stored head-major and viewed as [cells, heads, dim].
    let wide = rng.tensor(&[cells + 1, kvh + 1, hd]);
    let keys = wide.narrow(0, 1, cells).unwrap().narrow(1, 1, kvh).unwrap();
    let values = rng.tensor(&[kvh, cells, hd]).transpose(0, 1).unwrap();
    assert!(!keys.is_contiguous() && !values.is_contiguous());
    let q = rng.tensor(&[n, heads, hd]);
    let got = paged_attention(
        &q,
        &view(keys.clone(), values.clone(), VLayout::Normal, &runs),
        0.4,
    )
    .unwrap()
    .unwrap();
    let mut mask = vec![f32::NEG_INFINITY; n * cells];
    for r in 0..n {
        for c in runs.row(r).iter().flat_map(|c| c.cells()) {
            mask[r * cells + c] = 0.0;
        }
    }
    let want = reference(
        &f32s(&q),
        &f32s(&keys.contiguous().unwrap()),
        &f32s(&values.contiguous().unwrap()),
        &mask,
        (n, heads, kvh, hd, hd, cells),
        false,
        0.4,
    );
    let got = f32s(&got);
    let diff = got
        .iter()
        .zip(&want)
        .map(|(&a, &b)| (f64::from(a) - b).abs())
        .fold(0f64, f64::max);
    assert!(diff <= TOL, "{diff}");
    assert!(got[2 * heads * hd..3 * heads * hd].iter().all(|&x| x == 0.0));
    assert!(got[..heads * hd].iter().any(|&x| x != 0.0));

    // The permuted layout, values as a strided [heads, dim, cells] view.
    let permuted = values.permute((1, 2, 0)).unwrap();
    let again = paged_attention(&q, &view(keys, permuted, VLayout::Permuted, &runs), 0.4)
        .unwrap()
        .unwrap();
    assert_eq!(f32s(&again), got);
}

#[test]
fn shapes_that_do_not_fit_are_invalid_arguments() {
    let mut rng = Rng(8);
    let mut runs = RowRuns::default();
    runs.push_row(once(0..4));
    runs.push_row(once(0..5));
    let (keys, values) = (rng.tensor(&[6, 2, 8]), rng.tensor(&[6, 2, 8]));
    let bad = |q: Tensor, keys: &Tensor, values: &Tensor, runs: &RowRuns| {
        let v = view(keys.clone(), values.clone(), VLayout::Normal, runs);
        matches!(paged_attention(&q, &v, 1.0), Err(ModelError::InvalidArgument(_)))
    };
    assert!(paged_attention(
        &rng.tensor(&[2, 4, 8]),
        &view(keys.clone(), values.clone(), VLayout::Normal, &runs),
        1.0
    )
    .unwrap()
    .is_some());
    // Three query rows for two rows of runs.
    assert!(bad(rng.tensor(&[3, 4, 8]), &keys, &values, &runs));
    // Head dimensions that differ, heads that do not group.
    assert!(bad(rng.tensor(&[2, 4, 16]), &keys, &values, &runs));
    assert!(bad(rng.tensor(&[2, 3, 8]), &keys, &values, &runs));
    // Values of another cell count; a run past the cells; f64 queries.
    assert!(bad(rng.tensor(&[2, 4, 8]), &keys, &rng.tensor(&[5, 2, 8]), &runs));
    let mut far = RowRuns::default();
    far.push_row(once(0..7));
    assert!(bad(rng.tensor(&[1, 4, 8]), &keys, &values, &far));
    let q64 = rng.tensor(&[2, 4, 8]).to_dtype(CandleDType::F64).unwrap();
    assert!(bad(q64, &keys, &values, &runs));
}
