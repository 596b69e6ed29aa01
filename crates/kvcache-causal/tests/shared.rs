//! Several threads hammering one `CausalKvCache` through `kvcache_api::Shared`:
//! each thread owns a sequence and runs whole forward passes under the lock
//! (start_forward, then put and get on every layer), trims its tail now and
//! then, and one thread also shares its prefix with a spare sequence. Every pass
//! must see exactly its own sequence's keys; at the end every sequence holds
//! exactly the tokens its thread put, and the invariant checker passes.

mod common;

use std::sync::{Arc, Barrier};
use std::thread;

use kvcache_api::{Batch, CausalCache, CausalConfig, DType, ForwardMode, Pos, PosRange, SeqId, Shared};
use kvcache_causal::CausalKvCache;

use common::{filled, host};

const THREADS: usize = 6;
const SPARE: SeqId = THREADS;
const PASSES: usize = 120;
const LAYERS: usize = 2;

/// The key every element of token `pos` of sequence `seq` gets in `layer`.
fn code(seq: SeqId, pos: Pos, layer: usize) -> f32 {
    let v = (seq * 1000) as f32 + pos as f32;
    if layer == 0 {
        v
    } else {
        -v
    }
}

/// One forward pass of `n` tokens of `seq` from `next`, under one lock; checks
/// what the pass sees.
fn pass(cache: &Shared<CausalKvCache>, seq: SeqId, next: Pos, n: usize) {
    let mut c = cache.lock().unwrap();
    let batch = Batch::sequence(seq, next, n).unwrap();
    c.start_forward(&batch, ForwardMode::Compute).unwrap();
    let device = c.device().clone();
    for layer in 0..LAYERS {
        c.set_layer(layer);
        let vals: Vec<f32> = (0..n as Pos).map(|i| code(seq, next + i, layer)).collect();
        let kv = filled(&vals, 1, 2, DType::F32, &device);
        c.put(&kv, &kv).unwrap();
        let view = c.get().unwrap();
        let range = c.pass_range().unwrap();
        let mask = host(&view.mask);
        let keys = host(&view.keys);
        for i in 0..n {
            let row = &mask[i * range.len()..(i + 1) * range.len()];
            let mut seen: Vec<f32> = (0..range.len())
                .filter(|&j| row[j] == 0.0)
                .map(|j| keys[j * 2])
                .collect();
            seen.sort_by(|a, b| a.abs().total_cmp(&b.abs()));
            let want: Vec<f32> = (0..=next + i as Pos).map(|p| code(seq, p, layer)).collect();
            assert_eq!(
                seen,
                want,
                "thread {seq}, token {}, layer {layer}",
                next + i as Pos
            );
        }
    }
}

#[test]
fn threads_drive_whole_passes_and_keep_their_own_tokens() {
    let config = CausalConfig::new(THREADS + 1, 256, 8);
    let cache = Shared::new(CausalKvCache::new(config, common::device(), None).unwrap());
    let start = Arc::new(Barrier::new(THREADS));
    let workers: Vec<_> = (0..THREADS)
        .map(|seq| {
            let (cache, start) = (cache.clone(), start.clone());
            thread::spawn(move || -> Pos {
                start.wait();
                let mut next: Pos = 0;
                for k in 0..PASSES {
                    let n = 1 + (k + seq) % 3;
                    pass(&cache, seq, next, n);
                    next += n as Pos;
                    if k % 25 == 24 {
                        // Regenerate the last two tokens: remove them between passes.
                        cache
                            .with(|c| c.remove(seq, PosRange::from(next - 2..)))
                            .unwrap()
                            .unwrap();
                        next -= 2;
                    }
                    if seq == 0 && k % 20 == 10 {
                        let mut c = cache.lock().unwrap();
                        c.copy_prefix(0, SPARE, next / 2).unwrap();
                        let shared: Vec<(Pos, usize)> =
                            c.positions(0).into_iter().take(next as usize / 2).collect();
                        assert_eq!(c.positions(SPARE), shared);
                        c.check();
                    }
                }
                next
            })
        })
        .collect();
    let ends: Vec<Pos> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    let c = cache.lock().unwrap();
    c.check();
    for (seq, &end) in ends.iter().enumerate() {
        let positions = c.positions(seq);
        let held: Vec<Pos> = positions.iter().map(|p| p.0).collect();
        assert_eq!(held, (0..end).collect::<Vec<_>>(), "sequence {seq}");
        for &(pos, cell) in &positions {
            for layer in 0..LAYERS {
                let data = c.read_cell(layer, cell).unwrap();
                assert_eq!(
                    data.keys,
                    vec![code(seq, pos, layer); 2],
                    "seq {seq} pos {pos} layer {layer}"
                );
            }
        }
    }
    let spare = c.positions(SPARE);
    assert!(!spare.is_empty());
    assert!(spare.iter().all(|&(p, cell)| c.positions(0).contains(&(p, cell))));
}
