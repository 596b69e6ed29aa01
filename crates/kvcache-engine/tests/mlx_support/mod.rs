//! Drives the mlx Llama through the prefix trie over mlx `KvCache`s and compares
//! every logit row it produces with a full recompute without any cache.
#![allow(dead_code)]

use kvcache_api::SnapshotCache;
use kvcache_mlx::layers::KvCache;
use kvcache_models::argmax;
use kvcache_models::mlx::model::to_host;
use kvcache_models::mlx::MlxLlama;
use kvcache_trie::{PrefixCache, Stats};

/// Bytes one position takes in every layer's snapshot (keys and values, f32).
pub fn bytes_per_position(model: &MlxLlama) -> usize {
    let c = model.config();
    c.n_layers * 2 * c.n_kv_heads * c.head_dim * 4
}

/// Largest absolute difference between two equally long slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Requests run through one trie, with the largest difference seen.
pub struct Driver<'m> {
    pub model: &'m MlxLlama,
    pub trie: PrefixCache<KvCache>,
    /// Largest |cached - recomputed| over every logit row so far.
    pub max_diff: f32,
    /// Logit rows compared.
    pub rows: usize,
}

impl<'m> Driver<'m> {
    /// A trie over one `KvCache` per layer growing in steps of `step`,
    /// keeping at most `budget` bytes of snapshots.
    pub fn new(model: &'m MlxLlama, step: usize, budget: usize) -> Self {
        let caches = (0..model.config().n_layers)
            .map(|_| KvCache::with_step(step).unwrap())
            .collect();
        Driver {
            model,
            trie: PrefixCache::new(caches, budget).unwrap(),
            max_diff: 0.0,
            rows: 0,
        }
    }

    pub fn stats(&self) -> Stats {
        self.trie.stats()
    }

    /// Runs one request: restores what the trie has, prefills the rest, then
    /// generates `generate` greedy tokens (evaluating all but the last), and
    /// compares every logit row with a full recompute of the tokens the caches
    /// now hold. Returns those tokens (the conversation so far) and how many
    /// prompt tokens were restored.
    pub fn request(&mut self, prompt: &[u32], generate: usize) -> (Vec<u32>, usize) {
        let model = self.model;
        let vocab = model.config().vocab_size;
        let mut session = self.trie.begin(prompt).unwrap();
        let cached = session.cached();
        assert!(cached < prompt.len());
        for layer in session.caches() {
            assert_eq!(layer.offset(), cached);
        }
        // (first position, logits of consecutive positions, row-major)
        let mut got: Vec<(usize, Vec<f32>)> = Vec::new();
        session
            .prefill(|chunk, caches| -> kvcache_engine::Result<()> {
                let at = caches[0].offset();
                let h = model.hidden_layers(chunk, caches)?;
                got.push((at, to_host(&model.logits(&h)?)?));
                Ok(())
            })
            .unwrap();
        assert_eq!(
            got.first().map(|g| g.0),
            Some(cached),
            "prefill starts at the restored offset"
        );
        let mut held = prompt.to_vec();
        let last_row = |rows: &[f32]| argmax(&rows[rows.len() - vocab..]);
        let mut token = last_row(&got.last().unwrap().1);
        for i in 0..generate {
            session.record(token);
            if i + 1 == generate {
                break;
            }
            let at = session.offset();
            let h = model.hidden_layers(&[token], session.caches_mut()).unwrap();
            held.push(token);
            let row = to_host(&model.logits(&h).unwrap()).unwrap();
            token = last_row(&row);
            got.push((at, row));
        }
        session.close().unwrap();
        self.trie.check();
        assert_eq!(self.trie.offset(), held.len());
        let full = to_host(&model.forward_full(&held).unwrap()).unwrap();
        for (at, rows) in &got {
            let n = rows.len() / vocab;
            let want = &full[at * vocab..(at + n) * vocab];
            self.max_diff = self.max_diff.max(max_abs_diff(rows, want));
            self.rows += n;
        }
        (held, cached)
    }
}
