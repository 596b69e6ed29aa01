//! Sequences decoding side by side keep their cells in a few long runs
//! (placement reserves room for each), and attention through the cache still
//! sees exactly each sequence's own positions, through removals, prefix copies
//! and rollbacks that leave reservations behind.

mod common;

use candle_core::Device;
use kvcache_api::{Batch, CausalCache, CausalConfig, DType, ForwardMode, Pos, SeqId};
use kvcache_causal::CausalKvCache;

use common::{add_shift, device, filled, sees, Seen};

/// The value stored for position `pos` of sequence `seq`.
fn val(seq: SeqId, pos: Pos) -> f32 {
    (seq * 1000) as f32 + pos as f32
}

/// Runs one pass of `tokens`, each storing [`val`] as key and value.
fn pass(cache: &mut CausalKvCache, tokens: &[(SeqId, Pos)], device: &Device) {
    let batch = Batch::from_tokens(tokens.iter().copied()).unwrap();
    cache.start_forward(&batch, ForwardMode::Compute).unwrap();
    let vals: Vec<f32> = tokens.iter().map(|&(s, p)| val(s, p)).collect();
    let kv = filled(&vals, 1, 2, DType::F32, device);
    cache.set_layer(0);
    cache.put(&kv, &kv).unwrap();
}

/// What a token of `seq` at `pos` must see: positions `from..=pos`, each with
/// the value `value_of` gives.
fn expected(from: Pos, pos: Pos, value_of: impl Fn(Pos) -> f32) -> Seen {
    (from..=pos).map(|p| (p, value_of(p), value_of(p))).collect()
}

/// The number of cell runs each row of the pass sees.
fn runs_per_row(cache: &CausalKvCache, rows: usize) -> Vec<usize> {
    (0..rows)
        .map(|row| cache.visible_cells(row).unwrap().len())
        .collect()
}

fn decode_step(seqs: &[SeqId], next: &[Pos]) -> Vec<(SeqId, Pos)> {
    seqs.iter().map(|&s| (s, next[s])).collect()
}

#[test]
fn interleaved_decode_keeps_few_runs_and_sees_its_own_tokens() {
    let device = device();
    // 8 sequences x 512 positions = 4,096 cells; 100 tokens prefilled each, one
    // sequence after another, then 400 decode steps of all eight together.
    let mut cache = CausalKvCache::new(CausalConfig::new(8, 512, 64), device.clone(), None).unwrap();
    let seqs: Vec<SeqId> = (0..8).collect();
    for &seq in &seqs {
        for start in (0..100).step_by(50) {
            let tokens: Vec<_> = (start..start + 50).map(|p| (seq, p)).collect();
            pass(&mut cache, &tokens, &device);
        }
    }
    let mut next = vec![100; 8];
    for step in 0..400 {
        let tokens = decode_step(&seqs, &next);
        pass(&mut cache, &tokens, &device);
        let runs = runs_per_row(&cache, tokens.len());
        // Reservations grow with the sequence (half of it, at least 64): the
        // prefill's run, then at most four reserved ones up to position 500.
        assert!(runs.iter().all(|&r| r <= 5), "step {step}: runs per row {runs:?}");
        if step % 40 == 0 || step == 399 {
            let seen = sees(&cache, &tokens);
            for (&(seq, pos), seen) in tokens.iter().zip(&seen) {
                assert_eq!(
                    seen,
                    &expected(0, pos, |p| val(seq, p)),
                    "step {step}, sequence {seq}"
                );
            }
        }
        for n in next.iter_mut() {
            *n += 1;
        }
    }
    cache.check();
    // Without reservations (a compaction threshold keeps ranges dense) the same
    // decode gives every sequence a run per token, so the difference is real.
    let dense = CausalConfig::new(8, 512, 64).with_compact_threshold(Some(0.9));
    let mut cache = CausalKvCache::new(dense, device.clone(), None).unwrap();
    for &seq in &seqs {
        let tokens: Vec<_> = (0..50).map(|p| (seq, p)).collect();
        pass(&mut cache, &tokens, &device);
    }
    for pos in 50..60 {
        pass(&mut cache, &decode_step(&seqs, &[pos; 8]), &device);
    }
    assert_eq!(runs_per_row(&cache, 8)[0], 11);
}

#[test]
fn removals_copies_and_rollbacks_keep_attention_right() {
    let device = device();
    let config = CausalConfig::new(6, 400, 32);
    let mut cache = CausalKvCache::new(config, device.clone(), Some(add_shift())).unwrap();
    let seqs: Vec<SeqId> = (0..4).collect();
    for &seq in &seqs {
        let tokens: Vec<_> = (0..30).map(|p| (seq, p)).collect();
        pass(&mut cache, &tokens, &device);
    }
    let mut next = vec![30; 6];
    let decode = |cache: &mut CausalKvCache, next: &mut Vec<Pos>, steps: usize, seqs: &[SeqId]| {
        for _ in 0..steps {
            let tokens = decode_step(seqs, next);
            pass(cache, &tokens, &device);
            for &s in seqs {
                next[s] += 1;
            }
        }
    };
    decode(&mut cache, &mut next, 40, &seqs);
    let checkpoint = cache.try_clone().unwrap();
    let checkpoint_next = next.clone();

    // Sequence 1 drops its tail and sequence 2 a middle stretch (shifting the
    // rest down by 10, keys re-rotated by -10); sequence 3 is copied into 4.
    cache.remove(1, (50..).into()).unwrap();
    next[1] = 50;
    cache.remove(2, (20..30).into()).unwrap();
    next[2] -= 10;
    cache.copy_prefix(3, 4, 60).unwrap();
    next[4] = 60;
    let all: Vec<SeqId> = (0..5).collect();
    decode(&mut cache, &mut next, 100, &all);
    let tokens = decode_step(&all, &next);
    pass(&mut cache, &tokens, &device);
    let seen = sees(&cache, &tokens);
    let value_of = |seq: SeqId, p: Pos| -> f32 {
        match seq {
            // Positions 20.. came from 30.., their keys shifted by -10 and values kept;
            // the add-shift function moves keys only, so check the value column.
            2 if (20..next[2] - 100).contains(&p) => val(2, p + 10),
            2 => val(2, p),
            4 if p < 60 => val(3, p),
            _ => val(seq, p),
        }
    };
    for (&(seq, pos), seen) in tokens.iter().zip(&seen) {
        let positions: Vec<Pos> = seen.iter().map(|s| s.0).collect();
        assert_eq!(positions, (0..=pos).collect::<Vec<_>>(), "sequence {seq}");
        let values: Vec<f32> = seen.iter().map(|s| s.2).collect();
        let want: Vec<f32> = (0..=pos).map(|p| value_of(seq, p)).collect();
        assert_eq!(values, want, "sequence {seq}");
    }

    // Back to the checkpoint: its reservations come along, and decoding on from
    // there sees exactly the checkpoint's sequences.
    cache.try_clone_from(&checkpoint).unwrap();
    let mut next = checkpoint_next;
    decode(&mut cache, &mut next, 30, &seqs);
    let tokens = decode_step(&seqs, &next);
    pass(&mut cache, &tokens, &device);
    for (&(seq, pos), seen) in tokens.iter().zip(&sees(&cache, &tokens)) {
        assert_eq!(
            seen,
            &expected(0, pos, |p| val(seq, p)),
            "sequence {seq} after rollback"
        );
    }
    cache.check();
}
