//! Property tests: random schedules of batches over several sequences, removals
//! (middle and end), prefix copies, windows, chunks, both placements and compaction,
//! checked after every step against a naive model (`common::reference`): what each
//! query token sees through the real mask and storage, every stored key and value,
//! `can_resume`, and the errors of rejected steps, which must change nothing.
//! Checkpoints (`try_clone`) and rollbacks into the live cache (`try_clone_from`)
//! switch branches mid-schedule. Transfers export a range of one sequence and
//! import it into another (`export_seq` / `import_seq`). Block retention keeps a
//! sequence's blocks (`retain_blocks`), adopts a chain into an emptied sequence
//! (`adopt_blocks`), evicts least recently used blocks (`evict_blocks`, and a
//! pass that lacks cells by itself) and ages them out
//! (`forget_blocks_unused_for`), against the model's own index; after
//! every step the index's journal (`drain_block_changes`), replayed, equals
//! the model's index, blocks' tokens included, and routers fed the KV events
//! built from it hold exactly its full blocks.

mod common;

use candle_core::Tensor;
use std::collections::{BTreeMap, BTreeSet};

use kvcache_api::block_key::BlockKey;
use kvcache_api::events::{block_hash, EventBatch, KvEvent, Medium};
use kvcache_api::retention::{BlockChain, BlockChange};
use kvcache_api::{
    Batch, CacheError, CausalCache, CausalConfig, DType, ForwardMode, Placement, Pos, PosRange, SeqId,
    SlidingWindow, VLayout,
};
use kvcache_causal::CausalKvCache;
use proptest::prelude::*;

use common::reference::{same_error, Entry, Reference};
use common::{add_shift, contents, filled, sees};

const HEADS: usize = 2;
const DIM: usize = 3;
const DIM_V: usize = 2;

#[derive(Debug, Clone)]
struct Setup {
    config: CausalConfig,
    shift: bool,
}

fn setup() -> impl Strategy<Value = Setup> {
    let window = prop_oneof![
        2 => Just(None),
        1 => (1..=6usize, 0..=3usize, any::<bool>()).prop_map(|(w, extra, memory)| Some(if memory {
            SlidingWindow::with_memory(w, w + extra)
        } else {
            SlidingWindow::new(w)
        })),
    ];
    // Sequence counts past 64 give each cell a multi-word sequence set.
    let sequences = prop_oneof![6 => 1..=4usize, 1 => Just(66usize), 1 => Just(130usize)];
    let sizes = (sequences, 4..=20usize, 1..=6usize);
    let attention = (
        window,
        prop_oneof![3 => Just(None), 1 => (1..=4usize).prop_map(Some)],
    );
    let placement = (
        prop_oneof![Just(Placement::Scattered), Just(Placement::Contiguous)],
        prop_oneof![2 => Just(None), 1 => (0.0f32..0.9).prop_map(Some)],
        (1..=3usize, 1..=4usize),
    );
    let storage = (
        prop_oneof![Just(VLayout::Normal), Just(VLayout::Permuted)],
        prop_oneof![Just(DType::F32), Just(DType::F16)],
        prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::BF16)],
        any::<bool>(),
    );
    (sizes, attention, placement, storage).prop_map(
        |(
            (seqs, capacity, batch),
            (window, chunk),
            (place, threshold, padding),
            (layout, dtype, mask, shift),
        )| {
            let mut config = CausalConfig::new(seqs, capacity, batch)
                .with_placement(place)
                .with_compact_threshold(threshold)
                .with_padding(padding.0, padding.1)
                .with_v_layout(layout)
                .with_dtype(dtype)
                .with_mask_dtype(mask);
            if let Some(w) = window {
                config = config.with_window(w);
            }
            if let Some(c) = chunk {
                config = config.with_chunk_size(c);
            }
            Setup { config, shift }
        },
    )
}

#[derive(Debug, Clone)]
enum Op {
    /// Each part appends `tokens` positions to `seq` (after a gap of one when
    /// `gap`); tokens are shuffled by `shuffle`; `exempt` picks set_causal tokens.
    Batch {
        parts: Vec<(usize, usize)>,
        gap: bool,
        shuffle: u64,
        exempt: Vec<usize>,
    },
    /// remove(seq, start..start + len) or `start..` when `len` is `None`.
    Remove { seq: usize, start: u8, len: Option<u8> },
    /// copy_prefix(src, dst, len).
    Copy { src: usize, dst: usize, len: u8 },
    /// A call the cache must reject without changing anything.
    Bad { kind: u8, arg: u8 },
    /// Keep a deep copy of the cache (`try_clone`) and of the model.
    Checkpoint,
    /// Copy the checkpoint back into the cache (`try_clone_from`), a branch switch.
    Rollback,
    /// export_seq(src, start..start + len) then import_seq(dst, ..): the range
    /// starts where `dst` ends (mode 0), or at `start` within `src`, into `dst`
    /// emptied first (mode 1) or as it is (mode 2); `len` is clipped to `src`'s end
    /// where that leaves a position.
    Transfer {
        src: usize,
        dst: usize,
        mode: u8,
        start: u8,
        len: u8,
    },
    /// retain_blocks(seq, its chain in blocks of `block` tokens), then (when
    /// `finish`) remove the whole sequence, as an engine ends a request.
    Retain { seq: usize, block: usize, finish: bool },
    /// adopt_blocks(dst emptied first, the chain ending at the `pick`th indexed
    /// block, cut to its first `len` blocks, the last in part by `part`).
    Adopt { dst: usize, pick: u8, len: u8, part: u8 },
    /// forget_blocks(the `pick`th indexed block).
    Forget { pick: u8 },
    /// evict_blocks(all cells but `short`).
    Evict { short: u8 },
    /// clear_blocks().
    ClearBlocks,
    /// forget_blocks_unused_for(zero: every block; else a century: none).
    Age { all: bool },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (
            prop::collection::vec((0..4usize, 1..=6usize), 1..=3),
            prop::bool::weighted(0.1),
            any::<u64>(),
            prop::collection::vec(0..8usize, 0..=1),
        )
            .prop_map(|(parts, gap, shuffle, exempt)| Op::Batch { parts, gap, shuffle, exempt }),
        2 => (0..4usize, any::<u8>(), prop::option::weighted(0.7, 0..4u8))
            .prop_map(|(seq, start, len)| Op::Remove { seq, start, len }),
        1 => (0..4usize, 0..4usize, any::<u8>()).prop_map(|(src, dst, len)| Op::Copy { src, dst, len }),
        1 => (0..10u8, any::<u8>()).prop_map(|(kind, arg)| Op::Bad { kind, arg }),
        2 => (0..4usize, 1..=4usize, any::<bool>())
            .prop_map(|(seq, block, finish)| Op::Retain { seq, block, finish }),
        2 => (0..4usize, any::<u8>(), any::<u8>(), any::<u8>())
            .prop_map(|(dst, pick, len, part)| Op::Adopt { dst, pick, len, part }),
        1 => any::<u8>().prop_map(|pick| Op::Forget { pick }),
        1 => (0..8u8).prop_map(|short| Op::Evict { short }),
        1 => Just(Op::ClearBlocks),
        1 => any::<bool>().prop_map(|all| Op::Age { all }),
        1 => prop_oneof![Just(Op::Checkpoint), Just(Op::Rollback)],
        2 => (0..4usize, 0..4usize, prop_oneof![2 => Just(0u8), 2 => Just(1), 1 => Just(2)], any::<u8>(), 1..=8u8)
            .prop_map(|(src, dst, mode, start, len)| Op::Transfer { src, dst, mode, start, len }),
    ]
}

/// A deterministic shuffle (xorshift Fisher-Yates).
fn shuffle<T>(items: &mut [T], mut seed: u64) {
    for i in (1..items.len()).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        items.swap(i, (seed % (i as u64 + 1)) as usize);
    }
}

struct Run {
    cache: CausalKvCache,
    model: Reference,
    config: CausalConfig,
    device: candle_core::Device,
    next_val: f32,
    /// Tokens of the pass in progress, if any.
    pass: Option<Vec<(SeqId, Pos)>>,
    stored: bool,
    checkpoint: Option<Checkpoint>,
    /// Token ids of imported entries, counting down from `u64::MAX` (the model's
    /// own ids count up).
    next_import_id: u64,
    /// The block index as its journal tells it.
    journal: Journal,
}

/// What a router knows of the block index from its journal alone: every
/// block replayed with its parent and tokens, and per block size (1..=4, the
/// sizes `Op::Retain` keeps), the full blocks its KV events name.
#[derive(Debug, Clone, Default)]
struct Journal {
    blocks: BTreeMap<BlockKey, (BlockKey, Vec<u32>)>,
    routers: [BTreeSet<u64>; 4],
}

impl Journal {
    /// Replays `changes`, through the events builder for each router.
    fn replay(&mut self, changes: &[BlockChange]) {
        for change in changes {
            match change {
                BlockChange::Stored {
                    key, parent, tokens, ..
                } => {
                    assert!(
                        parent.is_root() || self.blocks.contains_key(parent),
                        "block {key:?} stored before its parent"
                    );
                    let old = self.blocks.insert(*key, (*parent, tokens.clone()));
                    assert!(old.is_none(), "block {key:?} stored twice");
                }
                BlockChange::Removed { key, len } => {
                    let (_, tokens) = self.blocks.remove(key).expect("a removed block was stored");
                    assert_eq!(tokens.len(), *len, "block {key:?} removed with another length");
                    assert!(
                        self.blocks.values().all(|(parent, _)| parent != key),
                        "block {key:?} removed before its children"
                    );
                }
            }
        }
        for (size, router) in self.routers.iter_mut().enumerate() {
            let mut batch = EventBatch::new(size + 1, Medium::Device);
            batch.block_changes(changes);
            for event in batch.into_events() {
                match event {
                    KvEvent::BlockStored {
                        block_hashes,
                        token_ids,
                        block_size,
                        ..
                    } => {
                        assert_eq!(token_ids.len(), block_hashes.len() * block_size);
                        router.extend(block_hashes);
                    }
                    KvEvent::BlockRemoved { block_hashes, .. } => {
                        for name in block_hashes {
                            assert!(router.remove(&name), "block {name:x} removed, never stored");
                        }
                    }
                    KvEvent::AllBlocksCleared => router.clear(),
                }
            }
        }
    }
}

/// A copy of the cache and everything the run knows about it.
struct Checkpoint {
    cache: CausalKvCache,
    model: Reference,
    pass: Option<Vec<(SeqId, Pos)>>,
    stored: bool,
    journal: Journal,
}

impl Run {
    /// The sequence an op's sequence number `i` (0..4) stands for: spread over the
    /// whole id range, so large caches use ids in every word of a cell's set.
    fn seq(&self, i: usize) -> SeqId {
        (i % 4) * self.config.max_sequences / 4
    }

    fn kv(&self, vals: &[f32], layer: usize, dim: usize) -> Tensor {
        let signed: Vec<f32> = vals.iter().map(|&v| if layer == 0 { v } else { -v }).collect();
        filled(&signed, HEADS, dim, self.config.dtype, &self.device)
    }

    /// Runs a call that must fail like `want`, and checks it changed nothing.
    fn rejected(
        &mut self,
        what: &str,
        want: CacheError,
        call: impl FnOnce(&mut CausalKvCache) -> Result<(), CacheError>,
    ) -> Result<(), TestCaseError> {
        let before = self.cache.picture().unwrap();
        let got = call(&mut self.cache);
        match got {
            Err(e) => prop_assert!(same_error(&e, &want), "{what}: got {e:?}, expected {want:?}"),
            Ok(()) => prop_assert!(false, "{what} should fail with {want:?}"),
        }
        self.cache.check();
        prop_assert!(
            self.cache.picture().unwrap() == before,
            "{what}: a rejected call changed the cache"
        );
        Ok(())
    }

    fn batch(
        &mut self,
        parts: &[(usize, usize)],
        gap: bool,
        seed: u64,
        exempt: &[usize],
    ) -> Result<(), TestCaseError> {
        let seqs = self.config.max_sequences;
        let mut next: Vec<Pos> = (0..seqs).map(|s| self.model.next_pos(s) + gap as Pos).collect();
        let mut tokens: Vec<(SeqId, Pos, f32)> = Vec::new();
        for &(seq, n) in parts {
            let seq = self.seq(seq);
            for _ in 0..n {
                if tokens.len() == self.config.max_batch {
                    break;
                }
                self.next_val += 1.0;
                tokens.push((seq, next[seq], self.next_val));
                next[seq] += 1;
            }
        }
        shuffle(&mut tokens, seed);
        let batch = Batch::from_tokens(tokens.iter().map(|t| (t.0, t.1))).unwrap();
        let expected = self.model.clone().forward(&tokens);
        if let Err(want) = expected {
            return self.rejected("start_forward", want, |c| {
                c.start_forward(&batch, ForwardMode::Compute)
            });
        }
        self.cache.start_forward(&batch, ForwardMode::Compute).unwrap();
        self.model.forward(&tokens).unwrap();
        self.cache.check();
        let vals: Vec<f32> = tokens.iter().map(|t| t.2).collect();
        for layer in 0..2 {
            self.cache.set_layer(layer);
            let (k, v) = (self.kv(&vals, layer, DIM), self.kv(&vals, layer, DIM_V));
            self.cache.put(&k, &v).unwrap();
        }
        self.stored = true;
        let exempt: Vec<usize> = exempt.iter().map(|&i| i % tokens.len()).collect();
        self.cache.set_causal(&exempt).unwrap();
        self.cache.check();
        let pass: Vec<(SeqId, Pos)> = batch.tokens().collect();
        for layer in 0..2 {
            self.cache.set_layer(layer);
            let seen = sees(&self.cache, &pass);
            for (i, &(seq, pos)) in pass.iter().enumerate() {
                let want = self.model.visible(seq, pos, exempt.contains(&i), layer);
                prop_assert_eq!(
                    &seen[i],
                    &want,
                    "layer {} token {} (seq {}, pos {})",
                    layer,
                    i,
                    seq,
                    pos
                );
            }
        }
        self.pass = Some(pass);
        Ok(())
    }

    fn remove(&mut self, seq: usize, start: u8, len: Option<u8>) -> Result<(), TestCaseError> {
        let seq = self.seq(seq);
        let start = Pos::from(start) % (self.model.next_pos(seq) + 2);
        let end = len.map(|l| start + Pos::from(l));
        let range = PosRange { start, end };
        match self.model.clone().remove(seq, start, end) {
            Err(want) => self.rejected("remove", want, |c| c.remove(seq, range)),
            Ok(()) => {
                self.cache.remove(seq, range).unwrap();
                self.model.remove(seq, start, end).unwrap();
                self.pass = None;
                Ok(())
            }
        }
    }

    fn copy(&mut self, src: usize, dst: usize, len: u8) -> Result<(), TestCaseError> {
        let (src, dst) = (self.seq(src), self.seq(dst));
        let len = Pos::from(len) % (self.model.next_pos(src) + 2);
        self.cache.copy_prefix(src, dst, len).unwrap();
        self.model.copy_prefix(src, dst, len).unwrap();
        self.pass = None;
        Ok(())
    }

    fn bad(&mut self, kind: u8, arg: u8) -> Result<(), TestCaseError> {
        let seqs = self.config.max_sequences;
        let seq = self.seq(usize::from(arg));
        let invalid = |m: &str| CacheError::InvalidArgument(m.into());
        match kind {
            0 => {
                let batch = Batch::sequence(seqs + usize::from(arg % 3), 0, 1).unwrap();
                let want = CacheError::SequenceOutOfRange {
                    seq: seqs + usize::from(arg % 3),
                    max_sequences: seqs,
                };
                self.rejected("out-of-range batch", want, |c| {
                    c.start_forward(&batch, ForwardMode::Compute)
                })
            }
            1 => {
                let Some(held) = self.model.seqs[seq].first().map(|e| e.pos) else {
                    return Ok(());
                };
                let batch = Batch::sequence(seq, held, 1).unwrap();
                let want = CacheError::InvalidBatch(String::new());
                self.rejected("repeated position", want, |c| {
                    c.start_forward(&batch, ForwardMode::Compute)
                })
            }
            2 | 3 => {
                if self.pass.is_none() {
                    let want = CacheError::InvalidState(String::new());
                    return self.rejected("get between passes", want, |c| c.get().map(|_| ()));
                }
                let n = self.pass.as_ref().map_or(0, Vec::len);
                let vals = vec![1.0; n];
                let (keys, want) = if kind == 2 {
                    let k = filled(&vals, HEADS + 1, DIM, self.config.dtype, &self.device);
                    (
                        k,
                        CacheError::ShapeMismatch {
                            what: "keys",
                            expected: vec![],
                            got: vec![],
                        },
                    )
                } else {
                    let other = if self.config.dtype == DType::F32 {
                        DType::BF16
                    } else {
                        DType::F32
                    };
                    let k = filled(&vals, HEADS, DIM, other, &self.device);
                    (
                        k,
                        CacheError::DTypeMismatch {
                            what: "keys",
                            expected: String::new(),
                            got: String::new(),
                        },
                    )
                };
                let values = self.kv(&vals, 0, DIM_V);
                self.rejected("bad put", want, |c| c.put(&keys, &values))
            }
            4 => {
                let range = if arg.is_multiple_of(2) {
                    PosRange { start: -1, end: None }
                } else {
                    PosRange {
                        start: 3,
                        end: Some(2),
                    }
                };
                self.rejected("bad removal range", invalid(""), |c| c.remove(seq, range))
            }
            5 => self.rejected("negative prefix", invalid(""), |c| c.copy_prefix(seq, 0, -1)),
            6 => match &self.pass {
                Some(p) => {
                    let n = p.len();
                    self.rejected("set_causal past the batch", invalid(""), |c| c.set_causal(&[n]))
                }
                None => {
                    let want = CacheError::InvalidState(String::new());
                    self.rejected("set_causal between passes", want, |c| c.set_causal(&[0]))
                }
            },
            8 => {
                // A chain one block longer than the sequence.
                let Some(chain) = self.model.chain(seq, 2) else {
                    return Ok(());
                };
                let mut blocks = chain.blocks().to_vec();
                blocks.push((BlockKey([arg.max(1); 32]), 1));
                let chain = BlockChain::from_parts(
                    *chain.fingerprint(),
                    chain.namespace().clone(),
                    blocks,
                    chain.tokens().to_vec(),
                );
                let want = match self.model.clone().retain(seq, &chain) {
                    Err(e) => e,
                    Ok(_) => return Ok(()),
                };
                self.rejected("retaining unheld positions", want, |c| {
                    c.retain_blocks(seq, &chain).map(|_| ())
                })
            }
            9 => {
                // Adopting into a sequence that holds positions, or a key
                // nobody indexed.
                let keys = match self.model.seqs[seq].is_empty() {
                    true => vec![BlockKey([arg.max(1); 32])],
                    false => self.model.blocks.keys().take(1).copied().collect(),
                };
                let want = match self.model.clone().adopt(seq, &keys, 1) {
                    Err(e) => e,
                    Ok(_) => return Ok(()),
                };
                self.rejected("bad adoption", want, |c| c.adopt_blocks(seq, &keys, 1))
            }
            _ => {
                let batch =
                    Batch::sequence(seq, self.model.next_pos(seq), self.config.max_batch + 1).unwrap();
                let want = CacheError::InvalidBatch(String::new());
                self.rejected("oversized batch", want, |c| {
                    c.start_forward(&batch, ForwardMode::Compute)
                })
            }
        }
    }

    fn transfer(
        &mut self,
        src: usize,
        dst: usize,
        mode: u8,
        start: u8,
        len: u8,
    ) -> Result<(), TestCaseError> {
        let (src, dst) = (self.seq(src), self.seq(dst));
        if mode == 1 {
            self.cache.remove(dst, PosRange { start: 0, end: None }).unwrap();
            self.model.remove(dst, 0, None).unwrap();
            self.pass = None;
        }
        let held = &self.model.seqs[src];
        let (first, next) = (held.first().map_or(0, |e| e.pos), self.model.next_pos(src));
        let start = match mode {
            0 => self.model.next_pos(dst),
            _ => first + Pos::from(start) % (next - first + 1),
        };
        let len = match next - start {
            room if room >= 1 => Pos::from(len).min(room),
            _ => Pos::from(len),
        };
        let range = start..start + len;
        let entries: Vec<Entry> = held.iter().filter(|e| range.contains(&e.pos)).cloned().collect();
        let expected = if entries.len() == range.len() {
            let (mut model, mut next_id) = (self.model.clone(), self.next_import_id);
            model_import(&mut model, &self.config, &mut next_id, dst, &entries).map(|()| (model, next_id))
        } else {
            Err(CacheError::InvalidArgument(String::new()))
        };
        let call = |c: &mut CausalKvCache| -> Result<(), CacheError> {
            let state = c.export_seq(src, range.clone())?;
            c.import_seq(dst, &state)
        };
        match expected {
            Err(want) => self.rejected("transfer", want, call),
            Ok((model, next_id)) => {
                call(&mut self.cache).unwrap();
                self.model = model;
                self.next_import_id = next_id;
                self.pass = None;
                Ok(())
            }
        }
    }

    fn retain(&mut self, seq: usize, block: usize, finish: bool) -> Result<(), TestCaseError> {
        let seq = self.seq(seq);
        let Some(chain) = self.model.chain(seq, block) else {
            return Ok(());
        };
        match self.model.clone().retain(seq, &chain) {
            Err(want) => self.rejected("retain", want, |c| c.retain_blocks(seq, &chain).map(|_| ())),
            Ok(added) => {
                let got = self.cache.retain_blocks(seq, &chain).unwrap();
                prop_assert_eq!(got, added, "blocks newly indexed");
                self.model.retain(seq, &chain).unwrap();
                if finish {
                    self.cache.remove(seq, PosRange { start: 0, end: None }).unwrap();
                    self.model.remove(seq, 0, None).unwrap();
                    self.pass = None;
                }
                Ok(())
            }
        }
    }

    fn adopt(&mut self, dst: usize, pick: u8, len: u8, part: u8) -> Result<(), TestCaseError> {
        let dst = self.seq(dst);
        if self.model.blocks.is_empty() {
            return Ok(());
        }
        let mut key = *self
            .model
            .blocks
            .keys()
            .nth(usize::from(pick) % self.model.blocks.len())
            .unwrap();
        let mut chain = vec![key];
        while let Some(b) = self.model.blocks.get(&key).filter(|b| !b.parent.is_root()) {
            key = b.parent;
            chain.push(key);
        }
        chain.reverse();
        chain.truncate(usize::from(len) % chain.len() + 1);
        let last = &self.model.blocks[chain.last().unwrap()].entries;
        let end = last[0].pos + 1 + Pos::from(part) % last.len() as Pos;
        self.cache.remove(dst, PosRange { start: 0, end: None }).unwrap();
        self.model.remove(dst, 0, None).unwrap();
        self.pass = None;
        match self.model.clone().adopt(dst, &chain, end) {
            Err(want) => self.rejected("adopt", want, |c| c.adopt_blocks(dst, &chain, end)),
            Ok(()) => {
                self.cache.adopt_blocks(dst, &chain, end).unwrap();
                self.model.adopt(dst, &chain, end).unwrap();
                Ok(())
            }
        }
    }

    fn forget(&mut self, pick: u8) -> Result<(), TestCaseError> {
        let Some(&key) = self
            .model
            .blocks
            .keys()
            .nth(usize::from(pick) % self.model.blocks.len().max(1))
        else {
            return Ok(());
        };
        let mut got = self.cache.forget_blocks(&[key]);
        got.sort();
        prop_assert_eq!(got, self.model.forget(&[key]), "blocks forgotten");
        Ok(())
    }

    fn evict(&mut self, short: u8) -> Result<(), TestCaseError> {
        let cells = self.config.num_cells().saturating_sub(usize::from(short));
        let want = self.model.evict(cells);
        prop_assert_eq!(self.cache.evict_blocks(cells), want, "blocks evicted");
        Ok(())
    }

    fn clear_blocks(&mut self) -> Result<(), TestCaseError> {
        let mut want = self.model.clear_blocks();
        let mut got = self.cache.clear_blocks();
        want.sort();
        got.sort();
        prop_assert_eq!(got, want, "blocks cleared");
        Ok(())
    }

    fn age(&mut self, all: bool) -> Result<(), TestCaseError> {
        let age = if all {
            std::time::Duration::ZERO
        } else {
            std::time::Duration::from_secs(100 * 365 * 24 * 3600)
        };
        let mut got = self.cache.forget_blocks_unused_for(age);
        got.sort();
        let mut want = if all {
            self.model.clear_blocks()
        } else {
            Vec::new()
        };
        want.sort();
        prop_assert_eq!(got, want, "blocks aged out");
        Ok(())
    }

    fn checkpoint(&mut self) {
        let cache = self.cache.try_clone().unwrap();
        assert!(
            cache.picture().unwrap() == self.cache.picture().unwrap(),
            "checkpoint differs"
        );
        cache.check();
        self.checkpoint = Some(Checkpoint {
            cache,
            model: self.model.clone(),
            pass: self.pass.clone(),
            stored: self.stored,
            journal: self.journal.clone(),
        });
    }

    fn rollback(&mut self) -> Result<(), TestCaseError> {
        let Some(saved) = &self.checkpoint else {
            return Ok(());
        };
        self.cache.try_clone_from(&saved.cache).unwrap();
        prop_assert!(
            self.cache.picture().unwrap() == saved.cache.picture().unwrap(),
            "rollback differs"
        );
        self.model = saved.model.clone();
        self.pass = saved.pass.clone();
        self.stored = saved.stored;
        // A branch switch replaces the index wholesale; a driver reports the
        // new one from scratch, as the run restores what it knew of it.
        self.journal = saved.journal.clone();
        Ok(())
    }

    fn compare(&mut self) -> Result<(), TestCaseError> {
        self.cache.check();
        // The journal, replayed, is the index: every block with its parent and
        // its tokens (the ids of the entries it keeps, so none is stale), and
        // each router holds exactly the full blocks of its size.
        let changes = self.cache.drain_block_changes();
        self.journal.replay(&changes);
        let want: BTreeMap<BlockKey, (BlockKey, Vec<u32>)> = self
            .model
            .blocks
            .iter()
            .map(|(key, b)| (*key, (b.parent, b.entries.iter().map(|e| e.id as u32).collect())))
            .collect();
        prop_assert_eq!(&self.journal.blocks, &want, "the journal replayed");
        for (size, router) in self.journal.routers.iter().enumerate() {
            let full: BTreeSet<u64> = want
                .iter()
                .filter(|(_, (_, tokens))| tokens.len() == size + 1)
                .map(|(key, _)| block_hash(&key.0))
                .collect();
            prop_assert_eq!(router, &full, "the router of blocks of {}", size + 1);
        }
        let kept: usize = self.model.blocks.values().map(|b| b.entries.len()).sum();
        prop_assert_eq!(
            self.cache.indexed_blocks(),
            (self.model.blocks.len(), kept),
            "the block index"
        );
        for key in self.model.blocks.keys() {
            prop_assert!(self.cache.holds_block(key), "block {:?} is missing", key);
        }
        if self.stored {
            for layer in 0..2 {
                prop_assert_eq!(
                    contents(&self.cache, layer),
                    self.model.contents(layer),
                    "layer {}",
                    layer
                );
            }
        }
        for seq in (0..4).map(|i| self.seq(i)) {
            let next = self.model.next_pos(seq);
            for pos in [0, next.saturating_sub(1), next, next + 1, next + 5] {
                prop_assert_eq!(
                    self.cache.can_resume(seq, pos),
                    self.model.can_resume(seq, pos),
                    "can_resume({}, {})",
                    seq,
                    pos
                );
            }
        }
        Ok(())
    }
}

/// The model of `import_seq(dst, ..)` of `entries` (consecutive positions): trims
/// like a pass whose last token of `dst` is the last imported position, then
/// stores the imported entries `dst` keeps, with new ids from `next_id` down.
fn model_import(
    model: &mut Reference,
    config: &CausalConfig,
    next_id: &mut u64,
    dst: SeqId,
    entries: &[Entry],
) -> Result<(), CacheError> {
    let (start, end) = (entries[0].pos, entries[entries.len() - 1].pos + 1);
    if model.seqs[dst].last().is_some_and(|e| e.pos + 1 != start) {
        return Err(CacheError::InvalidArgument(String::new()));
    }
    let memory = config.effective_memory().map(|m| m as Pos);
    let keep: Vec<Pos> = (0..config.max_sequences)
        .map(|s| match (memory, model.seqs[s].last()) {
            (None, _) => Pos::MIN,
            (Some(m), _) if s == dst => end - m,
            (Some(m), Some(last)) => last.pos + 2 - m,
            (Some(_), None) => Pos::MIN,
        })
        .collect();
    let live = |keep: &[Pos]| {
        let mut ids = model.block_ids();
        ids.extend((0..keep.len()).flat_map(|s| {
            model.seqs[s]
                .iter()
                .filter(move |e| e.pos >= keep[s])
                .map(|e| e.id)
        }));
        ids.len()
    };
    let kept: Vec<&Entry> = entries.iter().filter(|e| e.pos >= keep[dst]).collect();
    let cells = config.num_cells();
    if cells - live(&keep) < kept.len() {
        return Err(CacheError::Full {
            cells,
            used: live(&vec![Pos::MIN; keep.len()]),
            batch: kept.len(),
        });
    }
    for (s, held) in model.seqs.iter_mut().enumerate() {
        held.retain(|e| e.pos >= keep[s]);
    }
    for e in kept {
        *next_id -= 1;
        model.seqs[dst].push(Entry {
            id: *next_id,
            ..e.clone()
        });
    }
    Ok(())
}

fn run(setup: Setup, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let device = common::device();
    let shift = setup.shift.then(add_shift);
    let cache = CausalKvCache::new(setup.config.clone(), device.clone(), shift).unwrap();
    let mut r = Run {
        cache,
        model: Reference::new(&setup.config, setup.shift),
        config: setup.config,
        device,
        next_val: 0.0,
        pass: None,
        stored: false,
        checkpoint: None,
        next_import_id: u64::MAX,
        journal: Journal::default(),
    };
    for op in ops {
        match op {
            Op::Batch {
                parts,
                gap,
                shuffle,
                exempt,
            } => r.batch(&parts, gap, shuffle, &exempt)?,
            Op::Remove { seq, start, len } => r.remove(seq, start, len)?,
            Op::Copy { src, dst, len } => r.copy(src, dst, len)?,
            Op::Bad { kind, arg } => r.bad(kind, arg)?,
            Op::Checkpoint => r.checkpoint(),
            Op::Rollback => r.rollback()?,
            Op::Transfer {
                src,
                dst,
                mode,
                start,
                len,
            } => r.transfer(src, dst, mode, start, len)?,
            Op::Retain { seq, block, finish } => r.retain(seq, block, finish)?,
            Op::Adopt { dst, pick, len, part } => r.adopt(dst, pick, len, part)?,
            Op::Forget { pick } => r.forget(pick)?,
            Op::Evict { short } => r.evict(short)?,
            Op::ClearBlocks => r.clear_blocks()?,
            Op::Age { all } => r.age(all)?,
        }
        r.compare()?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn schedules_match_the_model(setup in setup(), ops in prop::collection::vec(op(), 1..60)) {
        run(setup, ops)?;
    }
}
