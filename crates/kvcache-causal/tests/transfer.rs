//! Sequence export and import: states round-trip with real random keys and values
//! (every layer, both value layouts, f32/f16/bf16) between caches and sequences;
//! attention over imported cells equals attention computed from scratch; every
//! rejected call returns a typed error and changes nothing.

mod common;

use std::collections::BTreeMap;

use candle_core::Tensor;
use kvcache_api::{
    Batch, CacheError, CausalCache, CausalConfig, DType, Fingerprint, ForwardMode, HostKv, KvLayout,
    Placement, Pos, SeqId, SlidingWindow, VLayout,
};
use kvcache_causal::{CausalKvCache, SeqKv};

use common::{candle, host, rejected};

/// Layers, kv heads and head dimensions of the tests' model.
#[derive(Debug, Clone, Copy)]
struct Shape {
    layers: usize,
    heads: usize,
    dim: usize,
    dim_v: usize,
}

const SHAPE: Shape = Shape {
    layers: 3,
    heads: 2,
    dim: 4,
    dim_v: 3,
};

/// A deterministic generator of values in `[-1, 1)`.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

/// One token's keys `[heads * dim]` and values `[heads * dim_v]` in one layer, as
/// stored (rounded to the cache's dtype).
type Kv = (Vec<f32>, Vec<f32>);

/// What each sequence was given: per position, each layer's keys and values.
type History = BTreeMap<(SeqId, Pos), Vec<Kv>>;

/// What `token` was given in `layer`.
fn kv_of(history: &History, token: (SeqId, Pos), layer: usize) -> &Kv {
    &history[&token][layer]
}

/// Runs one compute pass over `tokens` with random keys and values in every layer
/// and records them in `history`.
fn pass(
    cache: &mut CausalKvCache,
    tokens: &[(SeqId, Pos)],
    shape: Shape,
    rng: &mut Rng,
    history: &mut History,
) {
    let batch = Batch::from_tokens(tokens.iter().copied()).unwrap();
    cache.start_forward(&batch, ForwardMode::Compute).unwrap();
    let dtype = candle(cache.config().dtype);
    let device = cache.device().clone();
    let n = tokens.len();
    for layer in 0..shape.layers {
        cache.set_layer(layer);
        let make = |rng: &mut Rng, dim: usize| {
            Tensor::from_vec(rng.vec(n * shape.heads * dim), (n, shape.heads, dim), &device)
                .and_then(|t| t.to_dtype(dtype))
                .unwrap()
        };
        let (keys, values) = (make(rng, shape.dim), make(rng, shape.dim_v));
        cache.put(&keys, &values).unwrap();
        let (k, v) = (host(&keys), host(&values));
        for (i, &token) in tokens.iter().enumerate() {
            let kv = (
                k[i * shape.heads * shape.dim..(i + 1) * shape.heads * shape.dim].to_vec(),
                v[i * shape.heads * shape.dim_v..(i + 1) * shape.heads * shape.dim_v].to_vec(),
            );
            history.entry(token).or_default().push(kv);
        }
    }
    cache.check();
}

fn cache(config: CausalConfig) -> CausalKvCache {
    CausalKvCache::new(config, common::device(), None).unwrap()
}

/// The stored keys and values of every position of `seq`, every layer, by position.
fn stored(cache: &CausalKvCache, seq: SeqId, layers: usize) -> Vec<(Pos, Vec<Kv>)> {
    cache
        .positions(seq)
        .into_iter()
        .map(|(pos, cell)| {
            let per_layer = (0..layers)
                .map(|l| {
                    let d = cache.read_cell(l, cell).unwrap();
                    (d.keys, d.values)
                })
                .collect();
            (pos, per_layer)
        })
        .collect()
}

/// Little-endian elements of `dtype` as f32.
fn decode(bytes: &[u8], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes(c.try_into().unwrap()).to_f32())
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes(c.try_into().unwrap()).to_f32())
            .collect(),
    }
}

/// Row `row` of head-major `[heads, tokens, dim]` data, every head: `[heads * dim]`.
fn token_row(data: &[f32], heads: usize, tokens: usize, dim: usize, row: usize) -> Vec<f32> {
    (0..heads)
        .flat_map(|h| {
            data[(h * tokens + row) * dim..(h * tokens + row + 1) * dim]
                .iter()
                .copied()
        })
        .collect()
}

/// Fills sequences 0 and 1 interleaved (so sequence 0's cells form several runs):
/// sequence 0 at positions 0..20, sequence 1 at 0..10.
fn interleaved(config: CausalConfig, rng: &mut Rng, history: &mut History) -> CausalKvCache {
    let mut c = cache(config);
    for step in 0..5 {
        let mut tokens: Vec<(SeqId, Pos)> = (0..4).map(|k| (0, step * 4 + k)).collect();
        tokens.extend((0..2).map(|k| (1, step * 2 + k)));
        pass(&mut c, &tokens, SHAPE, rng, history);
    }
    c
}

#[test]
fn states_round_trip_between_caches_layouts_and_sequences() {
    let print = Fingerprint([7; 32]);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (from, to) in [
            (VLayout::Normal, VLayout::Permuted),
            (VLayout::Permuted, VLayout::Normal),
            (VLayout::Normal, VLayout::Normal),
        ] {
            let what = format!("{dtype} {from:?} -> {to:?}");
            let config = CausalConfig::new(3, 64, 8).with_dtype(dtype);
            let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
            let mut history = History::new();
            let mut src = interleaved(config.clone().with_v_layout(from), &mut rng, &mut history);
            src.set_fingerprint(print);
            assert_eq!(
                src.kv_layout(),
                Some(KvLayout {
                    layers: 3,
                    kv_heads: 2,
                    head_dim: 4,
                    head_dim_v: 3,
                    dtype
                })
            );
            let before = src.picture().unwrap();
            let state = src.export_seq(0, 3..17).unwrap();
            assert!(
                src.picture().unwrap() == before,
                "{what}: export changed the cache"
            );
            assert_eq!(state.fingerprint, print);
            assert_eq!(state.kv.range(), 3..17);
            assert_eq!(state.positions().unwrap(), 3..17);
            // The host form holds exactly what the passes stored, head-major.
            for layer in 0..SHAPE.layers {
                let rows = state.kv.layer(layer);
                let keys = decode(rows.keys, dtype);
                let values = decode(rows.values, dtype);
                for (row, pos) in (3..17).enumerate() {
                    let (k, v) = kv_of(&history, (0, pos), layer);
                    assert_eq!(
                        &token_row(&keys, 2, 14, 4, row),
                        k,
                        "{what}: layer {layer} key {pos}"
                    );
                    assert_eq!(
                        &token_row(&values, 2, 14, 3, row),
                        v,
                        "{what}: layer {layer} value {pos}"
                    );
                }
            }
            let want: Vec<(Pos, Vec<Kv>)> = (3..17).map(|p| (p, history[&(0, p)].clone())).collect();

            // Into a fresh cache with the other value layout.
            let mut dst = cache(config.clone().with_v_layout(to));
            dst.set_fingerprint(print);
            assert_eq!(dst.kv_layout(), None);
            dst.import_seq(1, &state).unwrap();
            dst.check();
            assert_eq!(dst.kv_layout(), src.kv_layout());
            assert_eq!(stored(&dst, 1, 3), want, "{what}: fresh cache");
            assert_eq!(dst.export_seq(1, 3..17).unwrap(), state, "{what}: re-export");

            // Into another sequence of the same cache, next to its own.
            src.import_seq(2, &state).unwrap();
            src.check();
            assert_eq!(stored(&src, 2, 3), want, "{what}: same cache");
            assert_eq!(src.export_seq(2, 3..17).unwrap(), state);
            // The source sequence is untouched.
            let mine: Vec<(Pos, Vec<Kv>)> = (0..20).map(|p| (p, history[&(0, p)].clone())).collect();
            assert_eq!(stored(&src, 0, 3), mine, "{what}: source sequence");

            // A single run of cells exports as well as scattered ones.
            let tail = src.export_seq(2, 10..12).unwrap();
            assert_eq!(tail.kv, state.kv.slice(10..12).unwrap());
        }
    }
}

#[test]
fn imports_continue_a_sequence_and_extend_past_a_batch() {
    let mut rng = Rng(42);
    let mut history = History::new();
    let config = CausalConfig::new(2, 64, 4).with_placement(Placement::Contiguous);
    let src = interleaved(
        CausalConfig::new(2, 64, 8).with_v_layout(VLayout::Permuted),
        &mut rng,
        &mut history,
    );
    let head = src.export_seq(0, 0..5).unwrap();
    let rest = src.export_seq(0, 5..20).unwrap();
    let mut dst = cache(config);
    dst.import_seq(0, &head).unwrap();
    // 15 tokens, more than a batch of 4, land in one run of cells.
    dst.import_seq(0, &rest).unwrap();
    dst.check();
    let cells: Vec<usize> = dst.positions(0).iter().map(|p| p.1).collect();
    assert!(cells[5..].windows(2).all(|w| w[1] == w[0] + 1), "{cells:?}");
    assert_eq!(
        dst.export_seq(0, 0..20).unwrap(),
        src.export_seq(0, 0..20).unwrap()
    );
    // A pass in progress ends with an import.
    dst.start_forward(&Batch::sequence(1, 0, 1).unwrap(), ForwardMode::Compute)
        .unwrap();
    dst.import_seq(1, &src.export_seq(1, 1..3).unwrap()).unwrap();
    dst.check();
    assert!(matches!(dst.get(), Err(CacheError::InvalidState(_))));
    assert_eq!(
        dst.positions(1).iter().map(|p| p.0).collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
}

#[test]
fn window_imports_keep_what_the_next_pass_needs() {
    let mut rng = Rng(5);
    let mut history = History::new();
    let mut src = cache(CausalConfig::new(1, 64, 4));
    for step in 0..3 {
        let tokens: Vec<(SeqId, Pos)> = (0..4).map(|k| (0, step * 4 + k)).collect();
        pass(&mut src, &tokens, SHAPE, &mut rng, &mut history);
    }
    // Window 3, two sequences: memory 4, 2 * 3 + 4 = 10 cells.
    let config = CausalConfig::new(2, 64, 4).with_window(SlidingWindow::new(3));
    let mut dst = cache(config);
    let mut other = History::new();
    pass(
        &mut dst,
        &[(1, 0), (1, 1), (1, 2), (1, 3)],
        SHAPE,
        &mut rng,
        &mut other,
    );
    pass(&mut dst, &[(0, 0), (0, 1)], SHAPE, &mut rng, &mut other);
    assert_eq!(dst.num_cells(), 10);
    // Ten positions 2..12 do not fit ten cells holding six, but only the last four
    // are kept; sequence 0's own 0..2 go, as a pass would trim them.
    dst.import_seq(0, &src.export_seq(0, 2..12).unwrap()).unwrap();
    dst.check();
    let want: Vec<(Pos, Vec<Kv>)> = (8..12).map(|p| (p, history[&(0, p)].clone())).collect();
    assert_eq!(stored(&dst, 0, 3), want);
    // Idle sequence 1 (next position 4) keeps 1..4, as in any pass.
    let idle: Vec<Pos> = dst.positions(1).iter().map(|p| p.0).collect();
    assert_eq!(idle, [1, 2, 3]);
    assert_eq!(dst.used_cells(), 7);
    // The window of 3 for positions 10..=12 is stored, not for 9.
    assert!((10..=12).all(|p| dst.can_resume(0, p)) && !dst.can_resume(0, 9));
}

/// Attention of query `q` (`[heads * dim]`) over keys and values by position.
fn attend(q: &[f32], seen: &[(&[f32], &[f32])], shape: Shape) -> Vec<f32> {
    let scale = 1.0 / (shape.dim as f32).sqrt();
    let mut out = vec![0.0; shape.heads * shape.dim_v];
    for h in 0..shape.heads {
        let qh = &q[h * shape.dim..(h + 1) * shape.dim];
        let scores: Vec<f32> = seen
            .iter()
            .map(|(k, _)| {
                let kh = &k[h * shape.dim..(h + 1) * shape.dim];
                qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f32>() * scale
            })
            .collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f32 = weights.iter().sum();
        for (w, (_, v)) in weights.iter().zip(seen) {
            for d in 0..shape.dim_v {
                out[h * shape.dim_v + d] += w / total * v[h * shape.dim_v + d];
            }
        }
    }
    out
}

/// Each pass token's attention output in `layer`, through the cache's own views
/// and mask: keys `[cells, heads, dim]`, values `[cells, heads, dim_v]` (or
/// permuted), mask `[rows, cells]`.
fn attend_cache(cache: &CausalKvCache, queries: &[Vec<f32>], shape: Shape) -> Vec<Vec<f32>> {
    let view = cache.get().unwrap();
    let cells = cache.pass_range().unwrap().len();
    let keys = host(&view.keys);
    let values = host(&view.values);
    let mask = host(&view.mask);
    let value_of = |j: usize| -> Vec<f32> {
        match cache.config().v_layout {
            VLayout::Normal => {
                values[j * shape.heads * shape.dim_v..(j + 1) * shape.heads * shape.dim_v].to_vec()
            }
            VLayout::Permuted => (0..shape.heads * shape.dim_v)
                .map(|e| values[e * cells + j])
                .collect(),
        }
    };
    queries
        .iter()
        .enumerate()
        .map(|(i, q)| {
            let seen: Vec<(Vec<f32>, Vec<f32>)> = (0..cells)
                .filter(|&j| mask[i * cells + j] == 0.0)
                .map(|j| {
                    let k = keys[j * shape.heads * shape.dim..(j + 1) * shape.heads * shape.dim].to_vec();
                    (k, value_of(j))
                })
                .collect();
            let refs: Vec<(&[f32], &[f32])> = seen.iter().map(|(k, v)| (&k[..], &v[..])).collect();
            attend(q, &refs, shape)
        })
        .collect()
}

#[test]
fn attention_over_imported_cells_equals_attention_from_scratch() {
    for (dtype, window, from, to, placement) in [
        (
            DType::F32,
            None,
            VLayout::Normal,
            VLayout::Permuted,
            Placement::Scattered,
        ),
        (
            DType::F16,
            None,
            VLayout::Permuted,
            VLayout::Normal,
            Placement::Contiguous,
        ),
        (
            DType::F32,
            Some(4),
            VLayout::Normal,
            VLayout::Normal,
            Placement::Contiguous,
        ),
        (
            DType::BF16,
            Some(3),
            VLayout::Permuted,
            VLayout::Permuted,
            Placement::Scattered,
        ),
    ] {
        let what = format!("{dtype} window {window:?} {from:?} -> {to:?} {placement:?}");
        let mut rng = Rng(0x1234_5678);
        let mut history = History::new();
        let base = CausalConfig::new(2, 64, 8).with_dtype(dtype);
        // The source computes sequence 0 at 0..20 (no window: it holds them all).
        let src = interleaved(base.clone().with_v_layout(from), &mut rng, &mut history);
        let state = src.export_seq(0, 0..20).unwrap();
        let mut config = base.with_v_layout(to).with_placement(placement);
        if let Some(w) = window {
            config = config.with_window(SlidingWindow::new(w));
        }
        let mut dst = cache(config.clone());
        // Another sequence already lives there.
        pass(
            &mut dst,
            &[(1, 0), (1, 1), (1, 2)],
            SHAPE,
            &mut rng,
            &mut History::new(),
        );
        dst.import_seq(0, &state).unwrap();
        dst.check();
        let positions: Vec<Pos> = dst.positions(0).iter().map(|p| p.0).collect();
        match config.effective_memory() {
            // What a pass ending at 19 keeps: the last `memory` positions.
            Some(memory) => assert_eq!(positions, (20 - memory as Pos..20).collect::<Vec<_>>(), "{what}"),
            None => assert_eq!(positions, (0..20).collect::<Vec<_>>(), "{what}"),
        }
        assert!(dst.can_resume(0, 20), "{what}");
        // New tokens 20..24 on the importing cache, attended layer by layer.
        let tokens: Vec<(SeqId, Pos)> = (20..24).map(|p| (0, p)).collect();
        pass(&mut dst, &tokens, SHAPE, &mut rng, &mut history);
        for layer in 0..SHAPE.layers {
            dst.set_layer(layer);
            let queries: Vec<Vec<f32>> = (0..tokens.len())
                .map(|_| rng.vec(SHAPE.heads * SHAPE.dim))
                .collect();
            let got = attend_cache(&dst, &queries, SHAPE);
            for (i, &(seq, pos)) in tokens.iter().enumerate() {
                let lo = window.map_or(0, |w| (pos - w as Pos + 1).max(0));
                let seen: Vec<(&[f32], &[f32])> = (lo..=pos)
                    .map(|p| {
                        let (k, v) = kv_of(&history, (seq, p), layer);
                        (&k[..], &v[..])
                    })
                    .collect();
                let want = attend(&queries[i], &seen, SHAPE);
                let diff = got[i]
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max);
                assert!(
                    diff < 1e-5,
                    "{what}: layer {layer} position {pos} differs by {diff}"
                );
            }
        }
    }
}

fn mismatch(what: &'static str) -> impl Fn(&CacheError) -> bool {
    move |e| matches!(e, CacheError::LayoutMismatch { what: w, .. } if *w == what)
}

fn invalid(e: &CacheError) -> bool {
    matches!(e, CacheError::InvalidArgument(_))
}

/// A state of `layout` for positions `start..start + tokens` with the default
/// fingerprint.
fn zeroed(layout: KvLayout, start: usize, tokens: usize) -> SeqKv {
    SeqKv {
        fingerprint: Fingerprint::default(),
        kv: HostKv::zeroed(layout, start, tokens),
    }
}

#[test]
fn rejected_imports_change_nothing() {
    let mut rng = Rng(7);
    let config = CausalConfig::new(2, 16, 4);
    let mut c = cache(config.clone());
    pass(
        &mut c,
        &[(0, 0), (0, 1), (0, 2)],
        SHAPE,
        &mut rng,
        &mut History::new(),
    );
    let layout = c.kv_layout().unwrap();
    let good = zeroed(layout, 3, 2);

    rejected(
        &mut c,
        |c| c.import_seq(2, &good),
        |e| {
            *e == CacheError::SequenceOutOfRange {
                seq: 2,
                max_sequences: 2,
            }
        },
    );
    let other_model = SeqKv {
        fingerprint: Fingerprint([1; 32]),
        ..good.clone()
    };
    rejected(&mut c, |c| c.import_seq(0, &other_model), mismatch("model"));
    for (what, bad) in [
        ("layers", KvLayout { layers: 2, ..layout }),
        ("layers", KvLayout { layers: 4, ..layout }),
        (
            "kv_heads",
            KvLayout {
                kv_heads: 1,
                ..layout
            },
        ),
        (
            "head_dim",
            KvLayout {
                head_dim: 8,
                ..layout
            },
        ),
        (
            "head_dim_v",
            KvLayout {
                head_dim_v: 4,
                ..layout
            },
        ),
        (
            "dtype",
            KvLayout {
                dtype: DType::F16,
                ..layout
            },
        ),
    ] {
        rejected(&mut c, |c| c.import_seq(1, &zeroed(bad, 0, 2)), mismatch(what));
    }
    // Sequence 0 ends at 2: an import must start at 3.
    for start in [0, 2, 4] {
        rejected(&mut c, |c| c.import_seq(0, &zeroed(layout, start, 2)), invalid);
    }
    rejected(&mut c, |c| c.import_seq(1, &zeroed(layout, 0, 0)), invalid);
    rejected(
        &mut c,
        |c| c.import_seq(1, &zeroed(layout, Pos::MAX as usize, 1)),
        invalid,
    );
    // 32 cells, 3 used: 30 more do not fit.
    rejected(
        &mut c,
        |c| c.import_seq(1, &zeroed(layout, 0, 30)),
        |e| {
            *e == CacheError::Full {
                cells: 32,
                used: 3,
                batch: 30,
            }
        },
    );
    // Mid-pass, a rejected import leaves the pass alone.
    let batch = Batch::sequence(1, 0, 2).unwrap();
    c.start_forward(&batch, ForwardMode::Compute).unwrap();
    rejected(&mut c, |c| c.import_seq(0, &other_model), mismatch("model"));
    rejected(
        &mut c,
        |c| c.import_seq(0, &zeroed(layout, 3, 40)),
        |e| matches!(e, CacheError::Full { .. }),
    );
    // The good state fits.
    c.import_seq(0, &good).unwrap();
    c.check();
    assert_eq!(c.positions(0).len(), 5);

    // A fresh cache checks only the dtype and the dimensions, then creates layers.
    let mut fresh = cache(config);
    rejected(
        &mut fresh,
        |c| {
            c.import_seq(
                0,
                &zeroed(
                    KvLayout {
                        dtype: DType::BF16,
                        ..layout
                    },
                    0,
                    1,
                ),
            )
        },
        mismatch("dtype"),
    );
    rejected(
        &mut fresh,
        |c| {
            c.import_seq(
                0,
                &zeroed(
                    KvLayout {
                        kv_heads: 0,
                        ..layout
                    },
                    0,
                    1,
                ),
            )
        },
        invalid,
    );
    let wide = KvLayout {
        layers: 5,
        kv_heads: 3,
        ..layout
    };
    fresh.import_seq(0, &zeroed(wide, 0, 2)).unwrap();
    fresh.check();
    assert_eq!(fresh.kv_layout(), Some(wide));
}

#[test]
fn rejected_exports_name_the_problem() {
    let mut rng = Rng(9);
    let mut c = cache(CausalConfig::new(2, 16, 4));
    assert!(matches!(
        c.export_seq(0, 0..1),
        Err(CacheError::InvalidArgument(_))
    ));
    // Positions 0, 1 and 3: 2 is missing.
    pass(
        &mut c,
        &[(0, 0), (0, 1), (0, 3)],
        SHAPE,
        &mut rng,
        &mut History::new(),
    );
    let before = c.picture().unwrap();
    for range in [0..3, 0..4, 2..3, 3..5, 1..1, -1..1] {
        assert!(
            matches!(
                c.export_seq(0, range.clone()),
                Err(CacheError::InvalidArgument(_))
            ),
            "{range:?}"
        );
    }
    assert_eq!(
        c.export_seq(2, 0..1).unwrap_err(),
        CacheError::SequenceOutOfRange {
            seq: 2,
            max_sequences: 2
        }
    );
    assert!(c.picture().unwrap() == before);
    assert_eq!(c.export_seq(0, 0..2).unwrap().kv.range(), 0..2);
    assert_eq!(c.export_seq(0, 3..4).unwrap().kv.range(), 3..4);

    // Sequences with cells but no layer storage (a pass without `put`).
    let mut bare = cache(CausalConfig::new(1, 8, 4));
    bare.start_forward(&Batch::sequence(0, 0, 2).unwrap(), ForwardMode::Compute)
        .unwrap();
    assert!(matches!(
        bare.export_seq(0, 0..2),
        Err(CacheError::InvalidState(_))
    ));
    // A layer below a stored one without storage.
    bare.set_layer(1);
    let kv = common::filled(&[1.0, 2.0], 2, 4, DType::F32, &common::device());
    bare.put(&kv, &kv).unwrap();
    assert!(matches!(
        bare.export_seq(0, 0..2),
        Err(CacheError::InvalidState(_))
    ));
}
