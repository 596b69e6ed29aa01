//! Quantized storage (`q8_0`, and f16/bf16 under an f32 model) against f32
//! storage: every operation is applied to a cache storing `q8_0` and to one
//! storing f32, and the quantized cache must hold exactly what the f32 one holds,
//! quantized afterwards (ggml's reference quantizer, written out below).
//!
//! Inputs are put already on the `q8_0` grid, so that the f32 cache's values are
//! exactly what the quantized cache decodes: then moving cells (compaction,
//! copy-prefix, removal without shift) must be exact, and a RoPE shift (decode,
//! rotate, re-quantize) must equal the f32 rotation quantized afterwards, also
//! exactly. Values off the grid are compared within the quantization bound.

mod common;

use candle_core::{DType as CandleDType, Tensor};
use common::device;
use kvcache_api::{
    Batch, CacheError, CausalCache, CausalConfig, DType, ForwardMode, KvStorage, Placement, Pos, PosRange,
    SeqId, StoredKv, VLayout,
};
use kvcache_causal::{CausalKvCache, RopeLayout, RopeShift};
use proptest::prelude::*;

const HEADS: usize = 2;
const DIM: usize = 64;
const LAYERS: usize = 2;
const SEQS: usize = 3;

/// ggml's `quantize_row_q8_0_ref` then `dequantize_row_q8_0`, block by block.
fn ggml_q8_0(x: &[f32]) -> Vec<f32> {
    x.chunks(32)
        .flat_map(|block| {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let d16 = half::f16::from_f32(d).to_f32();
            block.iter().map(move |v| (v * id).round() * d16)
        })
        .collect()
}

/// Deterministic values in about -2..2 for `n` elements.
fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
        })
        .collect()
}

fn config(storage: KvStorage, layout: VLayout, placement: Placement) -> CausalConfig {
    CausalConfig::new(SEQS, 8, 8)
        .with_v_layout(layout)
        .with_placement(placement)
        .with_compact_threshold(Some(0.25))
        .with_kv_storage(storage)
}

fn cache(config: CausalConfig) -> CausalKvCache {
    let shift = RopeShift::new(RopeLayout::Normal, DIM, 10000.0).unwrap();
    CausalKvCache::new(config, device(), Some(Box::new(shift))).unwrap()
}

/// One operation of a history.
#[derive(Debug, Clone)]
enum Op {
    /// A pass appending `n` tokens to each listed sequence.
    Forward(Vec<(SeqId, usize)>, u64),
    /// Removes a sequence's positions from `from` on (no shift).
    RemoveTail(SeqId, Pos),
    /// Shares a prefix of `len` positions.
    CopyPrefix(SeqId, SeqId, Pos),
    /// Removes positions `start..start + len`, shifting the later ones.
    Shift(SeqId, Pos, Pos),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (prop::collection::vec((0..SEQS, 1..4usize), 1..3), any::<u64>()).prop_map(|(s, seed)| Op::Forward(s, seed)),
        1 => (0..SEQS, 0..10 as Pos).prop_map(|(s, p)| Op::RemoveTail(s, p)),
        1 => (0..SEQS, 0..SEQS, 0..8 as Pos).prop_map(|(a, b, l)| Op::CopyPrefix(a, b, l)),
        1 => (0..SEQS, 0..6 as Pos, 1..4 as Pos).prop_map(|(s, p, l)| Op::Shift(s, p, l)),
    ]
}

/// Applies `op` to `cache`; a pass writes `values(layer, n)` as keys and values.
fn apply(cache: &mut CausalKvCache, op: &Op, on_grid: bool) -> Result<(), CacheError> {
    match op {
        Op::Forward(seqs, seed) => {
            let mut tokens = Vec::new();
            for &(seq, n) in seqs {
                let next = cache.positions(seq).last().map_or(0, |p| p.0 + 1);
                if tokens.iter().any(|&(s, _)| s == seq) {
                    continue;
                }
                tokens.extend((0..n as Pos).map(|k| (seq, next + k)));
            }
            let batch = Batch::from_tokens(tokens.iter().copied())?;
            cache.start_forward(&batch, ForwardMode::Compute)?;
            for layer in 0..LAYERS {
                cache.set_layer(layer);
                let n = tokens.len() * HEADS * DIM;
                let mut k = noise(n, seed.wrapping_add(2 * layer as u64));
                let mut v = noise(n, seed.wrapping_add(2 * layer as u64 + 1));
                if on_grid {
                    k = ggml_q8_0(&k);
                    v = ggml_q8_0(&v);
                }
                let shape = (tokens.len(), HEADS, DIM);
                let k = Tensor::from_vec(k, shape, cache.device()).unwrap();
                let v = Tensor::from_vec(v, shape, cache.device()).unwrap();
                cache.put(&k, &v)?;
            }
            Ok(())
        }
        Op::RemoveTail(seq, from) => cache.remove(*seq, PosRange::from(*from..)),
        Op::CopyPrefix(src, dst, len) => cache.copy_prefix(*src, *dst, *len),
        Op::Shift(seq, start, len) => cache.remove(*seq, PosRange::from(*start..start + len)),
    }
}

/// Every used cell's `(sequence list, position)` and its keys and values per
/// layer, by cell.
type Contents = Vec<(usize, Vec<SeqId>, Pos, Vec<(Vec<f32>, Vec<f32>)>)>;

fn contents(cache: &CausalKvCache) -> Contents {
    (0..cache.num_cells())
        .filter_map(|c| {
            let info = cache.cell(c)?;
            let data = (0..LAYERS)
                .map(|l| {
                    let d = cache.read_cell(l, c).unwrap();
                    (d.keys, d.values)
                })
                .collect();
            Some((c, info.sequences, info.pos, data))
        })
        .collect()
}

/// `contents` of the f32 cache, quantized afterwards.
fn quantized(contents: &Contents) -> Contents {
    contents
        .iter()
        .map(|(c, s, p, d)| {
            let d = d.iter().map(|(k, v)| (ggml_q8_0(k), ggml_q8_0(v))).collect();
            (*c, s.clone(), *p, d)
        })
        .collect()
}

/// Runs `ops` on a `q8_0` cache and an f32 cache side by side.
fn side_by_side(ops: &[Op], layout: VLayout, placement: Placement, on_grid: bool) {
    let mut q = cache(config(KvStorage::Q8_0, layout, placement));
    let mut f = cache(config(KvStorage::F32, layout, placement));
    let mut shifted = false;
    for op in ops {
        let before = q.picture().unwrap();
        let (rq, rf) = (apply(&mut q, op, on_grid), apply(&mut f, op, on_grid));
        assert_eq!(rq, rf, "{op:?}: both caches accept or reject alike");
        q.check();
        f.check();
        if rq.is_err() {
            if !matches!(op, Op::Forward(..)) {
                assert_eq!(
                    q.picture().unwrap(),
                    before,
                    "{op:?} was rejected: nothing changes"
                );
            }
            continue;
        }
        shifted |= matches!(op, Op::Shift(..)) && q.picture().unwrap() != before;
        let (got, want) = (contents(&q), quantized(&contents(&f)));
        if on_grid && !shifted {
            assert_eq!(got, want, "after {op:?}");
        } else if on_grid && matches!(op, Op::Shift(..)) && !ops_before_shift(ops, op) {
            assert_eq!(got, want, "first shift, after {op:?}");
        } else {
            within_bound(&got, &contents(&f), op);
        }
        if let (Op::Forward(..), Ok(view)) = (op, q.get()) {
            // `get` decodes exactly the pass's range, in the compute dtype.
            let range = q.pass_range().unwrap();
            assert_eq!(view.keys.dtype(), CandleDType::F32);
            assert_eq!(view.keys.dims(), &[range.len(), HEADS, DIM]);
            let first = range.clone().find_map(|c| q.cell(c).map(|_| c));
            if let Some(c) = first {
                let row = view.keys.get(c - range.start).unwrap().flatten_all().unwrap();
                assert_eq!(
                    row.to_vec1::<f32>().unwrap(),
                    q.read_cell(LAYERS - 1, c).unwrap().keys
                );
            }
            paged_view_reads_the_stored_blocks(&q, &f);
        }
    }
}

/// The paged view of a `q8_0` cache hands out its integers and scales as stored
/// (every cell, no decoding), rows seeing the cells the f32 cache's rows see,
/// and each visible cell's blocks decode to what `read_cell` reads.
fn paged_view_reads_the_stored_blocks(q: &CausalKvCache, f: &CausalKvCache) {
    let (paged, reference) = (q.get_paged().unwrap(), f.get_paged().unwrap());
    assert_eq!(paged.runs, reference.runs, "same bookkeeping, same runs");
    let StoredKv::Q8_0 { quants, scales } = &paged.keys else {
        panic!("q8_0 keys handed out as {:?}", paged.keys);
    };
    assert_eq!(
        (quants.dtype(), scales.dtype()),
        (CandleDType::U8, CandleDType::F16)
    );
    assert_eq!(quants.dims(), &[q.num_cells(), HEADS, DIM]);
    assert_eq!(scales.dims(), &[q.num_cells(), HEADS, DIM / 32]);
    assert!(matches!(reference.keys, StoredKv::Float(_)));
    let row = |t: &Tensor, cell: usize| -> Vec<f32> {
        let t = t.get(cell).unwrap().flatten_all().unwrap();
        t.to_dtype(CandleDType::F32).unwrap().to_vec1::<f32>().unwrap()
    };
    for cell in paged.runs.runs().iter().flat_map(|run| run.cells()) {
        let (ints, d) = (row(quants, cell), row(scales, cell));
        let decoded: Vec<f32> = ints
            .iter()
            .enumerate()
            .map(|(i, &b)| (b - 128.0) * d[i / 32])
            .collect();
        assert_eq!(
            decoded,
            q.read_cell(LAYERS - 1, cell).unwrap().keys,
            "cell {cell}"
        );
    }
}

/// Whether a shift that changed something came before `op` (the first shift is
/// exact on the grid; later ones re-quantize values off it).
fn ops_before_shift(ops: &[Op], op: &Op) -> bool {
    let at = ops.iter().position(|o| std::ptr::eq(o, op)).unwrap();
    ops[..at].iter().any(|o| matches!(o, Op::Shift(..)))
}

/// Each value within the q8_0 bound of the f32 one: twice the block's step,
/// which covers the first rounding, the rotation of a rounded pair and the
/// rounding after it.
fn within_bound(got: &Contents, f32s: &Contents, op: &Op) {
    assert_eq!(got.len(), f32s.len());
    for (g, w) in got.iter().zip(f32s) {
        assert_eq!((g.0, &g.1, g.2), (w.0, &w.1, w.2), "after {op:?}");
        for ((gk, gv), (wk, wv)) in g.3.iter().zip(&w.3) {
            for (a, b) in [(gk, wk), (gv, wv)] {
                for (ga, wa) in a.chunks(DIM).zip(b.chunks(DIM)) {
                    let amax = wa.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let bound = 2.0 * amax / 127.0 * 1.01;
                    for (x, y) in ga.iter().zip(wa) {
                        assert!((x - y).abs() <= bound, "{x} vs {y} (bound {bound}) after {op:?}");
                    }
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn q8_0_follows_f32_quantized_afterwards(
        ops in prop::collection::vec(op(), 1..14),
        permuted in any::<bool>(),
        contiguous in any::<bool>(),
        on_grid in any::<bool>(),
    ) {
        let layout = if permuted { VLayout::Permuted } else { VLayout::Normal };
        let placement = if contiguous { Placement::Contiguous } else { Placement::Scattered };
        side_by_side(&ops, layout, placement, on_grid);
    }
}

#[test]
fn compaction_moves_blocks_exactly() {
    // Sequence 0's removal leaves two holes of 4 cells; sequence 2's pass of 5
    // finds no run that long and compacts.
    let ops = [
        Op::Forward(vec![(0, 4), (1, 4)], 1),
        Op::Forward(vec![(0, 4), (1, 4)], 2),
        Op::Forward(vec![(2, 4)], 3),
        Op::RemoveTail(0, 0),
        Op::Forward(vec![(2, 5)], 4),
        Op::CopyPrefix(2, 0, 6),
        Op::Forward(vec![(0, 2), (1, 1)], 5),
        Op::Shift(1, 1, 2),
    ];
    for layout in [VLayout::Normal, VLayout::Permuted] {
        side_by_side(&ops, layout, Placement::Contiguous, true);
    }
    let mut q = cache(config(KvStorage::Q8_0, VLayout::Normal, Placement::Contiguous));
    for op in &ops[..5] {
        apply(&mut q, op, true).unwrap();
    }
    assert_eq!(
        q.positions(1).first(),
        Some(&(0, 0)),
        "sequence 1 moved to the front"
    );
    let used: Vec<usize> = (0..q.num_cells()).filter(|&c| q.cell(c).is_some()).collect();
    assert_eq!(
        used,
        (0..17).collect::<Vec<_>>(),
        "the pass compacted the cells to the front"
    );
}

#[test]
fn float_storage_under_an_f32_model_rounds_like_to_dtype() {
    for (storage, dtype) in [
        (KvStorage::F16, CandleDType::F16),
        (KvStorage::BF16, CandleDType::BF16),
    ] {
        let mut c = cache(config(storage, VLayout::Permuted, Placement::Scattered));
        let op = Op::Forward(vec![(0, 3), (1, 2)], 9);
        apply(&mut c, &op, false).unwrap();
        let mut f = cache(config(KvStorage::F32, VLayout::Permuted, Placement::Scattered));
        apply(&mut f, &op, false).unwrap();
        let (vc, vf) = (c.get().unwrap(), f.get().unwrap());
        assert_eq!(
            vc.values.dtype(),
            CandleDType::F32,
            "get returns the compute dtype"
        );
        let rounded = vf
            .values
            .to_dtype(dtype)
            .unwrap()
            .to_dtype(CandleDType::F32)
            .unwrap();
        assert_eq!(
            vc.values.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            rounded.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
        c.check();
    }
}

#[test]
fn bytes_per_cached_token() {
    let per_token = |storage| {
        let mut c = cache(config(storage, VLayout::Normal, Placement::Scattered));
        assert_eq!(c.storage_bytes_per_cell(), 0);
        apply(&mut c, &Op::Forward(vec![(0, 2)], 5), false).unwrap();
        c.storage_bytes_per_cell()
    };
    let values = LAYERS * 2 * HEADS * DIM;
    assert_eq!(per_token(KvStorage::F32), values * 4);
    assert_eq!(per_token(KvStorage::F16), values * 2);
    assert_eq!(per_token(KvStorage::BF16), values * 2);
    assert_eq!(per_token(KvStorage::Q8_0), values / 32 * 34);
    assert!(per_token(KvStorage::F32) as f64 / per_token(KvStorage::Q8_0) as f64 >= 3.7);
}

#[test]
fn q8_0_rejects_head_dims_off_the_block_and_changes_nothing() {
    let mut q = cache(config(KvStorage::Q8_0, VLayout::Normal, Placement::Scattered));
    q.start_forward(&Batch::sequence(0, 0, 2).unwrap(), ForwardMode::Compute)
        .unwrap();
    let before = q.picture().unwrap();
    let k = Tensor::zeros((2, HEADS, 48), CandleDType::F32, q.device()).unwrap();
    let e = q.put(&k, &k).unwrap_err();
    assert!(
        matches!(&e, CacheError::InvalidArgument(m) if m.contains("q8_0") && m.contains("48")),
        "{e}"
    );
    assert_eq!(q.picture().unwrap(), before);
    assert_eq!(q.storage_bytes(), 0);
    // Wrong dtype: the cache takes its compute dtype, not the storage type.
    let h = Tensor::zeros((2, HEADS, DIM), CandleDType::F16, q.device()).unwrap();
    assert!(matches!(q.put(&h, &h), Err(CacheError::DTypeMismatch { .. })));
    assert_eq!(q.picture().unwrap(), before);
    q.check();

    // An import whose head dimension is off the block.
    let mut small = CausalKvCache::new(CausalConfig::new(1, 8, 4), device(), None).unwrap();
    small
        .start_forward(&Batch::sequence(0, 0, 2).unwrap(), ForwardMode::Compute)
        .unwrap();
    small.put(&k, &k).unwrap();
    let state = small.export_seq(0, 0..2).unwrap();
    let mut q = cache(config(KvStorage::Q8_0, VLayout::Normal, Placement::Scattered));
    let before = q.picture().unwrap();
    assert!(matches!(
        q.import_seq(0, &state),
        Err(CacheError::InvalidArgument(_))
    ));
    assert_eq!(q.picture().unwrap(), before);
}

#[test]
fn exports_decode_to_the_compute_dtype_and_imports_quantize() {
    for layout in [VLayout::Normal, VLayout::Permuted] {
        let op = Op::Forward(vec![(0, 4), (1, 3)], 11);
        let mut q = cache(config(KvStorage::Q8_0, layout, Placement::Scattered));
        let mut f = cache(config(KvStorage::F32, layout, Placement::Scattered));
        apply(&mut q, &op, false).unwrap();
        apply(&mut f, &op, false).unwrap();
        let exported = q.export_seq(0, 1..4).unwrap();
        assert_eq!(exported.kv.layout().dtype, DType::F32);
        // The f32 state, quantized afterwards.
        let plain = f.export_seq(0, 1..4).unwrap();
        let floats = |b: &[u8]| -> Vec<f32> {
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        for layer in 0..LAYERS {
            let (a, b) = (exported.kv.layer(layer), plain.kv.layer(layer));
            assert_eq!(floats(a.keys), ggml_q8_0(&floats(b.keys)));
            assert_eq!(floats(a.values), ggml_q8_0(&floats(b.values)));
        }
        // The f32 state imported into a q8_0 cache reads back quantized.
        let mut into = cache(config(KvStorage::Q8_0, VLayout::Normal, Placement::Contiguous));
        into.import_seq(2, &plain).unwrap();
        into.check();
        assert_eq!(into.export_seq(2, 1..4).unwrap(), exported);
    }
}
