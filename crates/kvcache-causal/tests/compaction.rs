//! Compaction keeps every cell's keys and values with its recorded (sequence,
//! position): Ollama's defrag merges moves so that data and metadata end up swapped.

mod common;

use std::collections::BTreeMap;

use kvcache_api::{
    Batch, CausalCache, CausalConfig, DType, ForwardMode, Placement, Pos, PosRange, SeqId, VLayout,
};
use kvcache_causal::CausalKvCache;

use common::{add_shift, filled};

const LAYERS: usize = 3;

/// Expected (key, value) of layer `layer` for a token written with `val` whose key
/// was shifted by `delta`.
fn expected(val: f32, delta: f32, layer: usize) -> (f32, f32) {
    let v = val + 20.0 * layer as f32;
    (v + delta, v)
}

fn put_all(cache: &mut CausalKvCache, vals: &[f32], dtype: DType) {
    let device = cache.device().clone();
    for layer in 0..LAYERS {
        cache.set_layer(layer);
        let shifted: Vec<f32> = vals.iter().map(|v| v + 20.0 * layer as f32).collect();
        let k = filled(&shifted, 2, 4, dtype, &device);
        let v = filled(&shifted, 2, 3, dtype, &device);
        cache.put(&k, &v).unwrap();
    }
}

fn verify(cache: &CausalKvCache, written: &BTreeMap<(SeqId, Pos), (f32, f32)>) {
    let mut seen = 0;
    for seq in 0..cache.config().max_sequences {
        for (pos, cell) in cache.positions(seq) {
            let &(val, delta) = written
                .get(&(seq, pos))
                .unwrap_or_else(|| panic!("seq {seq} pos {pos} unknown"));
            for layer in 0..LAYERS {
                let data = cache.read_cell(layer, cell).unwrap();
                let (k, v) = expected(val, delta, layer);
                assert!(
                    data.keys.iter().all(|&x| x == k) && data.values.iter().all(|&x| x == v),
                    "layer {layer} cell {cell} (seq {seq}, pos {pos}): keys {:?} values {:?}, expected {k} / {v}",
                    data.keys,
                    data.values
                );
            }
            seen += 1;
        }
    }
    assert_eq!(seen, written.len());
}

fn compaction_moves_data_with_metadata(layout: VLayout, dtype: DType) {
    let config = CausalConfig::new(4, 16, 16)
        .with_placement(Placement::Contiguous)
        .with_v_layout(layout)
        .with_dtype(dtype);
    let mut cache = CausalKvCache::new(config, common::device(), Some(add_shift())).unwrap();
    let mut written: BTreeMap<(SeqId, Pos), (f32, f32)> = BTreeMap::new();
    // Four interleaved prefill rounds fill all 64 cells: cell c holds seq c % 4.
    let mut val = 0.0;
    for round in 0..4 {
        let tokens: Vec<(SeqId, Pos)> = (0..16).map(|i| (i % 4, (round * 4 + i / 4) as Pos)).collect();
        let batch = Batch::from_tokens(tokens.iter().copied()).unwrap();
        cache.start_forward(&batch, ForwardMode::Compute).unwrap();
        let vals: Vec<f32> = tokens
            .iter()
            .map(|&t| {
                val += 1.0;
                written.insert(t, (val, 0.0));
                val
            })
            .collect();
        put_all(&mut cache, &vals, dtype);
    }
    verify(&cache, &written);
    // Holes everywhere: sequence 1 goes, sequence 2 loses 3..6 (later keys shift),
    // sequence 3 loses 10...
    cache.remove(1, PosRange::from(0..)).unwrap();
    written.retain(|&(s, _), _| s != 1);
    cache.remove(2, PosRange::from(3..6)).unwrap();
    let seq2: Vec<((SeqId, Pos), (f32, f32))> = written
        .iter()
        .filter(|(k, _)| k.0 == 2)
        .map(|(k, v)| (*k, *v))
        .collect();
    for ((s, p), (v, d)) in seq2 {
        written.remove(&(s, p));
        if p < 3 {
            written.insert((s, p), (v, d));
        } else if p >= 6 {
            written.insert((s, p - 3), (v, d - 3.0));
        }
    }
    cache.remove(3, PosRange::from(10..)).unwrap();
    written.retain(|&(s, p), _| s != 3 || p < 10);
    cache.check();
    verify(&cache, &written);
    let before: Vec<(Pos, usize)> = cache.positions(0);
    // Twelve tokens need a run of 12 free cells: only compaction makes one.
    let batch = Batch::sequence(1, 0, 12).unwrap();
    cache.start_forward(&batch, ForwardMode::Compute).unwrap();
    cache.check();
    let cells = cache.pass_cells().to_vec();
    assert!(
        cells.windows(2).all(|w| w[1] == w[0] + 1),
        "contiguous placement: {cells:?}"
    );
    assert_ne!(before, cache.positions(0), "sequence 0 should have moved");
    let vals: Vec<f32> = (0..12)
        .map(|p| {
            val += 1.0;
            written.insert((1, p), (val, 0.0));
            val
        })
        .collect();
    put_all(&mut cache, &vals, dtype);
    verify(&cache, &written);
    // The used cells are now packed at the bottom, in their original order.
    assert_eq!(cache.used_cells(), written.len());
    assert!((0..written.len()).all(|c| cache.cell(c).is_some()));
}

#[test]
fn compaction_keeps_data_with_metadata_in_every_layout_and_dtype() {
    for layout in [VLayout::Normal, VLayout::Permuted] {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            compaction_moves_data_with_metadata(layout, dtype);
        }
    }
}

#[test]
fn threshold_compaction_keeps_data_with_metadata() {
    let config = CausalConfig::new(2, 32, 8).with_compact_threshold(Some(0.1));
    let mut cache = CausalKvCache::new(config, common::device(), None).unwrap();
    let mut written = BTreeMap::new();
    let mut val = 0.0;
    // Sequence 1 takes the bottom, sequence 0 lands above it, then sequence 1 goes.
    for (seq, n) in [(1, 8), (1, 8), (0, 4)] {
        let start = cache.positions(seq).len() as Pos;
        let batch = Batch::sequence(seq, start, n).unwrap();
        cache.start_forward(&batch, ForwardMode::Compute).unwrap();
        let vals: Vec<f32> = (0..n)
            .map(|i| {
                val += 1.0;
                written.insert((seq, start + i as Pos), (val, 0.0));
                val
            })
            .collect();
        put_all(&mut cache, &vals, DType::F32);
    }
    cache.remove(1, PosRange::from(0..)).unwrap();
    written.retain(|&(s, _), _| s != 1);
    let batch = Batch::sequence(0, 4, 1).unwrap();
    cache.start_forward(&batch, ForwardMode::Compute).unwrap();
    // Compacted: sequence 0's five cells are 0..5.
    assert_eq!(cache.pass_range(), Some(0..5));
    val += 1.0;
    written.insert((0, 4), (val, 0.0));
    put_all(&mut cache, &[val], DType::F32);
    verify(&cache, &written);
}
