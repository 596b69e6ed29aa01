//! Blocks kept by layer group: random schedules of requests on a Gemma-shaped
//! cache (a window group with memory, and a global group) against a model
//! with its own per-group index, step by step; and attention through the
//! cache against recomputation from each request's tokens, so a prefix the
//! cache says is resumable is one every group can really serve. Requests
//! resume from kept ends, evaluate in chunks, evict under pressure, keep
//! junctions while they go on, and end kept, cancelled or context-shifted;
//! between them blocks are evicted, forgotten and aged, and adoptions the
//! cache cannot serve are refused with nothing changed. Requests' parts go
//! through a store's round trip (the global group every position, the
//! window group its tail), are imported into another sequence and go on
//! there, and copies of their prefixes go on where they can resume.
//!
//! Every key and value a request writes at position `p` is a code of its
//! tokens `0..=p` (what a model would compute there): a query that sees a
//! cell of another prefix, or misses one of its window, sees other values.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use kvcache_api::block_key::{BlockKey, Scope};
use kvcache_api::retention::{BlockChain, Prefix};
use kvcache_api::{
    Batch, CacheError, CausalCache, CausalConfig, DType, Fingerprint, ForwardMode, Namespace, Pos, PosRange,
    SeqId, SeqKv, SlidingWindow,
};
use kvcache_causal::{CausalKvCache, LayerGroupCache};
use proptest::prelude::*;

use common::{contents, filled, sees};

const SEQS: usize = 3;
const BATCH: usize = 6;
/// Longest request (prompt and answer).
const LONGEST: usize = 20;

#[derive(Debug, Clone)]
struct Setup {
    /// Cells per sequence of the global group (it keeps blocks in what
    /// sequences do not use).
    capacity: usize,
    window: usize,
    memory: usize,
    block: usize,
    kept: usize,
}

fn setup() -> impl Strategy<Value = Setup> {
    (
        prop_oneof![Just(8usize), Just(24)],
        2..5usize,
        0..6usize,
        1..5usize,
        prop_oneof![Just(0usize), Just(8), Just(40)],
    )
        .prop_map(|(capacity, window, extra, block, kept)| Setup {
            capacity,
            window,
            memory: window + 1 + extra,
            block,
            kept,
        })
}

#[derive(Debug, Clone)]
enum Op {
    /// A request in sequence `seq`: the first `cut` tokens of an earlier
    /// request (`base` picks it) and then `extra`, answered with `answer`
    /// tokens, evaluated `chunk` tokens a pass; kept by block at the end, or
    /// cancelled.
    Request {
        seq: usize,
        base: u8,
        cut: u8,
        extra: Vec<u32>,
        answer: u8,
        chunk: u8,
        keep: bool,
        /// Keep the prefix up to here (a fraction of the request, in 256ths)
        /// once evaluated, while the request goes on: a junction.
        junction: Option<u8>,
        /// At the end, remove `n` positions from `at` (in 256ths of the
        /// request), shifting the later ones back: a context shift (the
        /// request is then not kept).
        shift: Option<(u8, u8)>,
    },
    /// `evict_blocks` until all but `short` cells are free.
    Evict { short: u8 },
    /// `forget_blocks` of one global block.
    Forget { pick: u8 },
    /// `forget_blocks_unused_for(0)`.
    Age,
    /// Adopting where the cache cannot resume: refused, nothing changes.
    BadAdopt { pick: u8, back: u8 },
    /// A request's parts as a prefix store keeps them (the global group
    /// every position, the window group the tail its memory keeps),
    /// imported into sequence `seq`, then its next token evaluated there;
    /// with `fork`, its first positions (in 256ths) first copied into
    /// another sequence, which goes on from there when it can resume.
    Restore {
        pick: u8,
        seq: usize,
        next: u32,
        fork: Option<(u8, usize)>,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0..SEQS, any::<u8>(), any::<u8>(), prop::collection::vec(0..3u32, 0..8), 0..6u8, 1..=BATCH as u8, prop::bool::weighted(0.85), prop::option::weighted(0.3, any::<u8>()), prop::option::weighted(0.1, (any::<u8>(), 1..4u8)))
            .prop_map(|(seq, base, cut, extra, answer, chunk, keep, junction, shift)| Op::Request { seq, base, cut, extra, answer, chunk, keep, junction, shift }),
        1 => (0..12u8).prop_map(|short| Op::Evict { short }),
        1 => any::<u8>().prop_map(|pick| Op::Forget { pick }),
        1 => Just(Op::Age),
        1 => (any::<u8>(), 1..4u8).prop_map(|(pick, back)| Op::BadAdopt { pick, back }),
        2 => (any::<u8>(), 0..SEQS, 0..3u32, prop::option::weighted(0.5, (any::<u8>(), 0..SEQS)))
            .prop_map(|(pick, seq, next, fork)| Op::Restore { pick, seq, next, fork }),
    ]
}

/// What a model computes at each position of `tokens`: a code of the
/// tokens up to it.
fn codes(tokens: &[u32]) -> Vec<f32> {
    let mut h: u32 = 0;
    tokens
        .iter()
        .map(|&t| {
            h = (h * 31 + t + 1) % 9973;
            h as f32
        })
        .collect()
}

fn scope_parts() -> (Fingerprint, Namespace) {
    (Fingerprint([5; 32]), Namespace::shared())
}

// ---- the model ----

/// One token a sequence holds, or a block keeps: its position, its cell's
/// identity, and its value.
#[derive(Debug, Clone, PartialEq)]
struct Entry {
    pos: Pos,
    id: u64,
    val: f32,
}

#[derive(Debug, Clone)]
struct MBlock {
    parent: BlockKey,
    entries: Vec<Entry>,
    /// The tokens its key names.
    tokens: Vec<u32>,
    used: u64,
    /// When it was indexed (children are looked up in this order).
    order: u64,
}

impl MBlock {
    fn span(&self) -> (Pos, Pos) {
        let start = self.entries[0].pos;
        (start, start + self.entries.len() as Pos)
    }
}

/// One group: its sequences and its index.
#[derive(Debug, Clone)]
struct MGroup {
    window: Option<Pos>,
    memory: Option<Pos>,
    cells: usize,
    tails: bool,
    seqs: Vec<Vec<Entry>>,
    blocks: BTreeMap<BlockKey, MBlock>,
    clock: u64,
    order: u64,
    next_id: u64,
}

impl MGroup {
    fn new(config: &CausalConfig) -> Self {
        let memory = config.effective_memory().map(|m| m as Pos);
        MGroup {
            window: config.window.map(|w| w.window() as Pos),
            memory,
            cells: config.num_cells(),
            tails: memory.is_some(),
            seqs: vec![Vec::new(); SEQS],
            blocks: BTreeMap::new(),
            clock: 0,
            order: 0,
            next_id: 0,
        }
    }

    fn pins(&self, id: u64) -> usize {
        self.blocks
            .values()
            .filter(|b| b.entries.iter().any(|e| e.id == id))
            .count()
    }

    fn held(&self, id: u64) -> bool {
        self.seqs.iter().flatten().any(|e| e.id == id)
    }

    /// Cells in use when each sequence keeps its positions from `keep[s]`.
    fn live(&self, keep: &[Pos]) -> usize {
        let mut ids: BTreeSet<u64> = self
            .blocks
            .values()
            .flat_map(|b| b.entries.iter().map(|e| e.id))
            .collect();
        for (s, entries) in self.seqs.iter().enumerate() {
            ids.extend(entries.iter().filter(|e| e.pos >= keep[s]).map(|e| e.id));
        }
        ids.len()
    }

    fn keep_lines(&self, seq: SeqId, lowest: Pos) -> Vec<Pos> {
        (0..SEQS)
            .map(|s| {
                let Some(m) = self.memory else { return Pos::MIN };
                let next = match (s == seq, self.seqs[s].last()) {
                    (true, _) => lowest,
                    (false, Some(last)) => last.pos + 1,
                    (false, None) => return Pos::MIN,
                };
                next.saturating_sub(m - 1)
            })
            .collect()
    }

    fn is_leaf(&self, key: &BlockKey, gone: &[BlockKey]) -> bool {
        self.tails
            || self
                .blocks
                .iter()
                .filter(|(_, b)| b.parent == *key)
                .all(|(k, _)| gone.contains(k))
    }

    /// The least recently used leaves whose eviction frees a cell until
    /// `need` cells are free, and whether that is enough.
    fn eviction_plan(&self, need: usize) -> (Vec<BlockKey>, bool) {
        let no_trim = vec![Pos::MIN; SEQS];
        let mut have = self.cells - self.live(&no_trim);
        let mut plan: Vec<BlockKey> = Vec::new();
        let mut taken: BTreeMap<u64, usize> = BTreeMap::new();
        while have < need {
            let victim = self
                .blocks
                .iter()
                .filter(|(k, b)| {
                    !plan.contains(k)
                        && self.is_leaf(k, &plan)
                        && b.entries.iter().any(|e| {
                            self.pins(e.id) - taken.get(&e.id).copied().unwrap_or(0) == 1 && !self.held(e.id)
                        })
                })
                .min_by_key(|(k, b)| (b.used, **k))
                .map(|(k, _)| *k);
            let Some(key) = victim else {
                return (plan, false);
            };
            for e in &self.blocks[&key].entries {
                let n = taken.entry(e.id).or_insert(0);
                *n += 1;
                if *n == self.pins(e.id) && !self.held(e.id) {
                    have += 1;
                }
            }
            plan.push(key);
        }
        (plan, true)
    }

    /// A pass of positions `start..start + vals.len()` of `seq`.
    fn forward(&mut self, seq: SeqId, start: Pos, vals: &[f32]) -> Result<(), ()> {
        let n = vals.len();
        let keep = self.keep_lines(seq, start);
        let no_trim = vec![Pos::MIN; SEQS];
        let used = self.live(&no_trim);
        let trimmed = used - self.live(&keep);
        let free = self.cells - used + trimmed;
        if free < n && !self.blocks.is_empty() {
            let (plan, enough) = self.eviction_plan(n - trimmed);
            if enough {
                for key in plan {
                    self.blocks.remove(&key);
                }
            } else {
                return Err(());
            }
        } else if free < n {
            return Err(());
        }
        for (s, entries) in self.seqs.iter_mut().enumerate() {
            entries.retain(|e| e.pos >= keep[s]);
        }
        for (k, &val) in vals.iter().enumerate() {
            self.seqs[seq].push(Entry {
                pos: start + k as Pos,
                id: self.next_id,
                val,
            });
            self.next_id += 1;
        }
        Ok(())
    }

    /// An import of positions `start..start + vals.len()` into `seq`: every
    /// sequence trimmed as by a pass whose lowest token is the last one
    /// imported, the positions `seq` then keeps stored; no block evicted.
    fn import(&mut self, seq: SeqId, start: Pos, vals: &[f32]) -> Result<(), ()> {
        let end = start + vals.len() as Pos;
        let keep = self.keep_lines(seq, end - 1);
        let kept = keep[seq].max(start);
        let free = self.cells - self.live(&keep);
        if free < (end - kept) as usize {
            return Err(());
        }
        for (s, entries) in self.seqs.iter_mut().enumerate() {
            entries.retain(|e| e.pos >= keep[s]);
        }
        for pos in kept..end {
            self.seqs[seq].push(Entry {
                pos,
                id: self.next_id,
                val: vals[(pos - start) as usize],
            });
            self.next_id += 1;
        }
        Ok(())
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Keeps blocks `from..` of `chain` out of `seq`'s entries; the indices
    /// newly indexed.
    fn retain(&mut self, seq: SeqId, chain: &BlockChain, from: usize) -> Vec<usize> {
        let blocks = chain.blocks();
        let mut added = Vec::new();
        let mut start: Pos = blocks[..from].iter().map(|b| b.1 as Pos).sum();
        for (i, &(key, len)) in blocks.iter().enumerate().skip(from) {
            let end = start + len as Pos;
            let used = self.tick();
            match self.blocks.get_mut(&key) {
                Some(b) => b.used = used,
                None => {
                    let entries: Vec<Entry> = self.seqs[seq]
                        .iter()
                        .filter(|e| (start..end).contains(&e.pos))
                        .cloned()
                        .collect();
                    assert_eq!(entries.len(), len, "the model retains held positions only");
                    let parent = if i == 0 { BlockKey::ROOT } else { blocks[i - 1].0 };
                    self.order += 1;
                    self.blocks.insert(
                        key,
                        MBlock {
                            parent,
                            entries,
                            tokens: chain.block_tokens(i).to_vec(),
                            used,
                            order: self.order,
                        },
                    );
                    added.push(i);
                }
            }
            start = end;
        }
        added
    }

    /// The first block a window group keeps of `chain` held by `seq`.
    fn tail_from(&self, seq: SeqId, chain: &BlockChain) -> usize {
        let memory = self.memory.expect("a window");
        let blocks = chain.blocks();
        let end: Pos = blocks.iter().map(|b| b.1 as Pos).sum();
        let mut from = blocks.len();
        let mut block_end = end;
        while from > 0 {
            let start = block_end - blocks[from - 1].1 as Pos;
            let held = (start..block_end).all(|p| self.seqs[seq].iter().any(|e| e.pos == p));
            if block_end <= end - memory + 1 || !held {
                break;
            }
            from -= 1;
            block_end = start;
        }
        from
    }

    fn adopt(&mut self, seq: SeqId, keys: &[BlockKey], len: Pos) {
        let used = self.tick();
        for key in keys {
            let b = self.blocks.get_mut(key).expect("adopted blocks are kept");
            b.used = used;
            let entries: Vec<Entry> = b.entries.iter().filter(|e| e.pos < len).cloned().collect();
            self.seqs[seq].extend(entries);
        }
    }

    /// Forgets `key` (and, in a forest, what follows it).
    fn forget(&mut self, key: &BlockKey) -> Vec<BlockKey> {
        if !self.blocks.contains_key(key) {
            return Vec::new();
        }
        let mut gone = vec![*key];
        let mut i = 0;
        while i < gone.len() && !self.tails {
            let parent = gone[i];
            gone.extend(
                self.blocks
                    .iter()
                    .filter(|(_, b)| b.parent == parent)
                    .map(|(k, _)| *k),
            );
            i += 1;
        }
        for k in &gone {
            self.blocks.remove(k);
        }
        gone
    }

    fn first_needed(&self, spans: &[(Pos, Pos)], at: Pos) -> usize {
        if !self.tails {
            return 0;
        }
        let from = self.window.map_or(0, |w| (at - w + 1).max(0));
        spans.partition_point(|s| s.1 <= from)
    }

    /// The first block a sequence resuming at `at` adopts: back from `at`
    /// while kept and within the memory.
    fn first_adopted(&self, keys: &[BlockKey], spans: &[(Pos, Pos)], at: Pos) -> usize {
        let Some(memory) = self.memory.filter(|_| self.tails) else {
            return 0;
        };
        let mut first = spans.partition_point(|s| s.0 < at);
        while first > 0 {
            let i = first - 1;
            let kept = self.blocks.get(&keys[i]).is_some_and(|b| b.span() == spans[i]);
            if spans[i].1 <= at - memory + 1 || !kept {
                break;
            }
            first = i;
        }
        first
    }

    fn covers(&self, keys: &[BlockKey], spans: &[(Pos, Pos)], at: Pos) -> bool {
        let first = self.first_needed(spans, at);
        let last = spans.partition_point(|s| s.0 < at);
        (first..last).all(|i| self.blocks.get(&keys[i]).is_some_and(|b| b.span() == spans[i]))
    }
}

#[derive(Debug, Clone)]
struct MEnd {
    len: Pos,
    junction: bool,
    block: Pos,
    tails: Vec<(usize, BlockKey)>,
}

/// The layer-group cache: group 0 with the window, group 1 global.
#[derive(Debug, Clone)]
struct Model {
    groups: Vec<MGroup>,
    ends: BTreeMap<BlockKey, MEnd>,
    origins: BTreeMap<SeqId, Vec<BlockKey>>,
}

impl Model {
    /// The first group keeping whole chains (a window whose memory spans
    /// the whole capacity keeps them too).
    fn global(&self) -> usize {
        self.groups.iter().position(|g| !g.tails).expect("a global group")
    }

    /// The first group keeping tails, if any.
    fn window(&self) -> Option<usize> {
        self.groups.iter().position(|g| g.tails)
    }

    fn longest_prefix(&self, tokens: &[u32], limit: usize) -> Prefix {
        let global = &self.groups[self.global()];
        let limit = limit.min(tokens.len());
        let mut found = Prefix::default();
        let mut parent = BlockKey::ROOT;
        while found.len < limit {
            let rest = &tokens[found.len..limit];
            let mut children: Vec<(&BlockKey, &MBlock)> =
                global.blocks.iter().filter(|(_, b)| b.parent == parent).collect();
            children.sort_by_key(|(_, b)| b.order);
            let mut best: Option<(usize, BlockKey, usize)> = None;
            for (key, b) in children {
                let matched = b.tokens.iter().zip(rest).take_while(|(a, b)| a == b).count();
                if matched > 0 && best.is_none_or(|(m, _, _)| matched > m) {
                    best = Some((matched, *key, b.entries.len()));
                }
            }
            let Some((matched, key, len)) = best else { break };
            found.keys.push(key);
            found.len += matched;
            if matched < len {
                break;
            }
            parent = key;
        }
        self.resumable(found)
    }

    fn spans(&self, keys: &[BlockKey]) -> Vec<(Pos, Pos)> {
        keys.iter()
            .map_while(|k| self.groups[self.global()].blocks.get(k).map(MBlock::span))
            .collect()
    }

    fn resumable(&self, found: Prefix) -> Prefix {
        let spans = self.spans(&found.keys);
        let len = found.len as Pos;
        let candidates = std::iter::once(len).chain(spans.iter().rev().map(|s| s.1).filter(|&e| e < len));
        for at in candidates.filter(|&at| at > 0) {
            if self.groups.iter().all(|g| g.covers(&found.keys, &spans, at)) {
                let n = spans.partition_point(|s| s.0 < at);
                return Prefix {
                    keys: found.keys[..n].to_vec(),
                    len: at as usize,
                };
            }
        }
        Prefix::default()
    }

    fn adopt(&mut self, seq: SeqId, keys: &[BlockKey], len: Pos) {
        let spans = self.spans(keys);
        for g in &mut self.groups {
            let first = g.first_adopted(keys, &spans, len);
            g.adopt(seq, &keys[first..], len);
        }
        let Some(w) = self.window() else { return };
        let last = *keys.last().unwrap();
        let from: Vec<BlockKey> = self
            .ends
            .iter()
            .filter(|(_, e)| {
                !e.junction && len <= e.len && len > e.len - e.block && e.tails.contains(&(w, last))
            })
            .map(|(k, _)| *k)
            .collect();
        self.origins.insert(seq, from);
    }

    /// Removes `start..end` of `seq`, shifting the later positions back: the
    /// blocks keeping a cell that moves go (with what follows them).
    fn shift(&mut self, seq: SeqId, start: Pos, end: Pos) {
        for g in &mut self.groups {
            let moved: BTreeSet<u64> = g.seqs[seq]
                .iter()
                .filter(|e| e.pos >= end)
                .map(|e| e.id)
                .collect();
            let over: Vec<BlockKey> = g
                .blocks
                .iter()
                .filter(|(_, b)| b.entries.iter().any(|e| moved.contains(&e.id)))
                .map(|(k, _)| *k)
                .collect();
            for key in over {
                g.forget(&key);
            }
            g.seqs[seq].retain(|e| e.pos < start || e.pos >= end);
            for e in g.seqs[seq].iter_mut().filter(|e| e.pos >= end) {
                e.pos -= end - start;
            }
        }
        self.settle();
    }

    fn forward(&mut self, seq: SeqId, start: Pos, vals: &[f32]) -> Result<(), ()> {
        let mut groups = self.groups.clone();
        for g in &mut groups {
            g.forward(seq, start, vals)?;
        }
        self.groups = groups;
        self.settle();
        Ok(())
    }

    /// `dst` shares `src`'s cells below `len` (and nothing else).
    fn copy(&mut self, src: SeqId, dst: SeqId, len: Pos) {
        for g in &mut self.groups {
            g.seqs[dst] = g.seqs[src].iter().filter(|e| e.pos < len).cloned().collect();
        }
    }

    /// Whether `seq` can go on at `pos`: it ends right before it, and a
    /// window group holds the window before it.
    fn can_resume(&self, seq: SeqId, pos: Pos, window: usize) -> bool {
        self.groups.iter().all(|g| {
            if g.memory.is_none() {
                return true;
            }
            match (g.seqs[seq].first(), g.seqs[seq].last()) {
                (Some(first), Some(last)) => {
                    first.pos <= (pos - window as Pos + 1).max(0) && pos <= last.pos + 1
                }
                _ => false,
            }
        })
    }

    /// An import into the empty `seq` of `vals` (positions `0..n`): the
    /// global group every one, a window group those from `window_start`
    /// that it keeps; all groups or none.
    fn import(&mut self, seq: SeqId, window_start: Pos, vals: &[f32]) -> Result<(), ()> {
        let mut groups = self.groups.clone();
        for g in &mut groups {
            let start = if g.tails { window_start } else { 0 };
            g.import(seq, start, &vals[start as usize..])?;
        }
        self.groups = groups;
        self.settle();
        Ok(())
    }

    fn remove(&mut self, seq: SeqId) {
        for g in &mut self.groups {
            g.seqs[seq].clear();
        }
        self.origins.remove(&seq);
    }

    fn unneeded(&self, tails: Vec<(usize, BlockKey)>) -> Vec<(usize, BlockKey)> {
        tails
            .into_iter()
            .filter(|t| !self.ends.values().any(|e| e.tails.contains(t)))
            .collect()
    }

    fn release(&mut self, last: &BlockKey) {
        if let Some(end) = self.ends.remove(last) {
            for (g, key) in self.unneeded(end.tails) {
                self.groups[g].forget(&key);
            }
            self.prune(last);
        }
    }

    /// Forgets the global blocks up the chain from `last` that lead to no
    /// end.
    fn prune(&mut self, last: &BlockKey) {
        if self.window().is_none() {
            return;
        }
        let global = self.global();
        let blocks = &mut self.groups[global].blocks;
        let mut key = *last;
        while let Some(b) = blocks.get(&key) {
            let leaf = !blocks.values().any(|c| c.parent == key);
            if self.ends.contains_key(&key) || !leaf {
                break;
            }
            let parent = b.parent;
            blocks.remove(&key);
            key = parent;
        }
    }

    fn prune_leaves(&mut self) {
        let global = self.global();
        let blocks = &self.groups[global].blocks;
        let leaves: Vec<BlockKey> = blocks
            .keys()
            .filter(|k| !blocks.values().any(|c| c.parent == **k) && !self.ends.contains_key(k))
            .copied()
            .collect();
        for leaf in leaves {
            self.prune(&leaf);
        }
    }

    fn settle(&mut self) {
        let broken: Vec<BlockKey> = self
            .ends
            .iter()
            .filter(|(last, e)| {
                !self.groups[self.global()].blocks.contains_key(last)
                    || e.tails
                        .iter()
                        .any(|(g, k)| !self.groups[*g].blocks.contains_key(k))
            })
            .map(|(k, _)| *k)
            .collect();
        for last in broken {
            self.release(&last);
        }
        self.prune_leaves();
    }

    fn retain(&mut self, seq: SeqId, chain: &BlockChain) -> Vec<usize> {
        let global = self.global();
        let mut added = Vec::new();
        let mut tails = Vec::new();
        let mut every_window = true;
        for (g, group) in self.groups.iter_mut().enumerate() {
            let from = if group.tails {
                group.tail_from(seq, chain)
            } else {
                0
            };
            let new = group.retain(seq, chain, from);
            if g == global {
                added = new;
            } else if group.tails {
                every_window &= from < chain.blocks().len();
                tails.extend(chain.blocks()[from..].iter().map(|b| (g, b.0)));
            }
        }
        let last = chain.blocks().last().unwrap().0;
        let len = chain.tokens().len() as Pos;
        let junction = self.groups[global].seqs[seq].iter().map(|e| e.pos).max() >= Some(len);
        let origins = if junction {
            Vec::new()
        } else {
            self.origins.remove(&seq).unwrap_or_default()
        };
        let end = MEnd {
            len,
            junction,
            block: chain.blocks()[0].1 as Pos,
            tails,
        };
        let unneeded = if every_window {
            let old = self.ends.insert(last, end);
            old.map_or_else(Vec::new, |old| self.unneeded(old.tails))
        } else {
            self.unneeded(end.tails)
        };
        for (g, key) in unneeded {
            self.groups[g].forget(&key);
        }
        if !every_window {
            self.prune(&last);
        }
        for origin in origins.iter().filter(|&&o| o != last) {
            self.release(origin);
        }
        self.settle();
        added
    }
}

// ---- the run ----

struct Run {
    cache: LayerGroupCache,
    model: Model,
    setup: Setup,
    /// Every request's tokens, in order.
    history: Vec<Vec<u32>>,
    /// The last requests' parts as a store keeps them: their tokens, the
    /// window group's tail and the global group's every position.
    exported: Vec<(Vec<u32>, SeqKv, SeqKv)>,
}

impl Run {
    fn new(setup: Setup) -> Self {
        let window = CausalConfig::new(SEQS, setup.capacity, BATCH)
            .with_window(SlidingWindow::with_memory(setup.window, setup.memory))
            .with_kept_cells(setup.kept);
        let global = CausalConfig::new(SEQS, setup.capacity, BATCH);
        let device = common::device();
        let groups = vec![
            CausalKvCache::new(window.clone(), device.clone(), Some(common::add_shift())).unwrap(),
            CausalKvCache::new(global.clone(), device, Some(common::add_shift())).unwrap(),
        ];
        Run {
            cache: LayerGroupCache::new(groups, vec![0, 1]).unwrap(),
            model: Model {
                groups: vec![MGroup::new(&window), MGroup::new(&global)],
                ends: BTreeMap::new(),
                origins: BTreeMap::new(),
            },
            setup,
            history: Vec::new(),
            exported: Vec::new(),
        }
    }

    fn chain(&self, tokens: &[u32]) -> BlockChain {
        let (fp, ns) = scope_parts();
        BlockChain::new(fp, ns, self.setup.block, tokens)
    }

    #[allow(clippy::too_many_arguments)]
    fn request(
        &mut self,
        seq: SeqId,
        base: u8,
        cut: u8,
        extra: &[u32],
        answer: u8,
        chunk: u8,
        keep: bool,
        junction: Option<u8>,
        shift: Option<(u8, u8)>,
    ) -> Result<(), TestCaseError> {
        let mut tokens: Vec<u32> = match self.history.len() {
            0 => Vec::new(),
            n => {
                let earlier = &self.history[usize::from(base) % n];
                earlier[..usize::from(cut) % (earlier.len() + 1)].to_vec()
            }
        };
        tokens.extend_from_slice(extra);
        tokens.push(7); // every prompt ends in a token of its own turn
        tokens.truncate(LONGEST - usize::from(answer));
        let prompt_len = tokens.len();
        let (fp, ns) = scope_parts();
        let found = self
            .cache
            .longest_prefix(Scope::new(&fp, &ns), &tokens, prompt_len - 1);
        let want = self.model.longest_prefix(&tokens, prompt_len - 1);
        prop_assert_eq!(&found, &want, "the longest resumable prefix of {:?}", tokens);
        self.cache.remove(seq, PosRange { start: 0, end: None }).unwrap();
        self.model.remove(seq);
        if found.len > 0 {
            self.cache
                .adopt_blocks(seq, &found.keys, found.len as Pos)
                .unwrap();
            self.model.adopt(seq, &found.keys, found.len as Pos);
        }
        for k in 0..usize::from(answer) {
            tokens.push((tokens[prompt_len - 1 + k] + k as u32) % 3);
        }
        let vals = codes(&tokens);
        let mut junction =
            junction.map(|j| found.len + 1 + usize::from(j) * (tokens.len() - found.len) / 256);
        let mut at = found.len;
        while at < tokens.len() {
            let n = usize::from(chunk).min(tokens.len() - at);
            let batch = Batch::sequence(seq, at as Pos, n).unwrap();
            let got = self.cache.start_forward(&batch, ForwardMode::Compute);
            let want = self.model.forward(seq, at as Pos, &vals[at..at + n]);
            match (got, want) {
                (Ok(()), Ok(())) => {}
                (Err(CacheError::Full { .. }), Err(())) => {
                    self.cancel(seq);
                    return Ok(());
                }
                (got, want) => {
                    return Err(TestCaseError::fail(format!(
                        "a pass of {n} at {at}: the cache says {got:?}, the model {want:?}"
                    )))
                }
            }
            self.put_and_check(seq, at, &vals, n)?;
            at += n;
            if let Some(j) = junction.filter(|&j| j <= at && j < tokens.len()) {
                junction = None;
                let chain = self.chain(&tokens[..j]);
                let added = self.cache.retain_blocks(seq, &chain).unwrap();
                prop_assert_eq!(
                    added,
                    self.model.retain(seq, &chain),
                    "a junction's new global blocks"
                );
            }
        }
        self.history.push(tokens.clone());
        self.export(seq, &tokens)?;
        if let Some((at, n)) = shift {
            let start = usize::from(at) * tokens.len() / 256;
            let end = (start + usize::from(n)).min(tokens.len());
            self.cache
                .remove(
                    seq,
                    PosRange {
                        start: start as Pos,
                        end: Some(end as Pos),
                    },
                )
                .unwrap();
            self.model.shift(seq, start as Pos, end as Pos);
            self.cancel(seq);
            return Ok(());
        }
        if keep {
            let chain = self.chain(&tokens);
            let added = self.cache.retain_blocks(seq, &chain).unwrap();
            prop_assert_eq!(
                added,
                self.model.retain(seq, &chain),
                "global blocks newly indexed"
            );
        }
        self.cancel(seq);
        Ok(())
    }

    /// Copies the first `prefix.len()` positions of `src` into `dst`, then
    /// evaluates `next` after them in `dst` when every group can resume
    /// there (the window group holds the window before it).
    fn fork(&mut self, src: SeqId, dst: SeqId, prefix: &[u32], next: u32) -> Result<(), TestCaseError> {
        let cut = prefix.len();
        self.cancel(dst);
        self.cache.copy_prefix(src, dst, cut as Pos).unwrap();
        self.model.copy(src, dst, cut as Pos);
        self.compare()?;
        let resumable = self.cache.can_resume(dst, cut as Pos);
        prop_assert_eq!(
            resumable,
            self.model.can_resume(dst, cut as Pos, self.setup.window),
            "resume a copy at {}",
            cut
        );
        if resumable {
            let mut tokens = prefix.to_vec();
            tokens.push(next);
            let vals = codes(&tokens);
            self.next_token(dst, cut, &vals)?;
            self.compare()?;
        }
        self.cancel(dst);
        Ok(())
    }

    /// Evaluates position `at` of `seq` (its value `vals[at]`) in both, and
    /// checks what it sees unless both are full.
    fn next_token(&mut self, seq: SeqId, at: usize, vals: &[f32]) -> Result<(), TestCaseError> {
        let batch = Batch::sequence(seq, at as Pos, 1).unwrap();
        let got = self.cache.start_forward(&batch, ForwardMode::Compute);
        let want = self.model.forward(seq, at as Pos, &vals[at..at + 1]);
        match (got, want) {
            (Ok(()), Ok(())) => self.put_and_check(seq, at, vals, 1),
            (Err(CacheError::Full { .. }), Err(())) => Ok(()),
            (got, want) => Err(TestCaseError::fail(format!(
                "a pass of one at {at}: the cache says {got:?}, the model {want:?}"
            ))),
        }
    }

    fn cancel(&mut self, seq: SeqId) {
        self.cache.remove(seq, PosRange { start: 0, end: None }).unwrap();
        self.model.remove(seq);
    }

    /// Exports `seq`'s parts, which it holds: all of `tokens` evaluated.
    fn export(&mut self, seq: SeqId, tokens: &[u32]) -> Result<(), TestCaseError> {
        let len = tokens.len();
        let parts = self.cache.store_parts();
        // From where the window group holds the request (a request resumed
        // from a kept tail holds what it adopted), at most its memory.
        let held = self.cache.part_start(0, seq) as usize;
        let first = parts[0].first_kept(len).max(held);
        let window = self.cache.export_part(0, seq, first as Pos..len as Pos);
        let global = self.cache.export_part(1, seq, 0..len as Pos);
        prop_assert!(
            window.is_ok() && global.is_ok(),
            "{:?} {:?}",
            window.err(),
            global.err()
        );
        self.exported
            .push((tokens.to_vec(), window.unwrap(), global.unwrap()));
        if self.exported.len() > 4 {
            self.exported.remove(0);
        }
        Ok(())
    }

    fn restore(
        &mut self,
        pick: u8,
        seq: SeqId,
        next: u32,
        fork: Option<(u8, usize)>,
    ) -> Result<(), TestCaseError> {
        let Some((tokens, window, global)) = self
            .exported
            .get(usize::from(pick) % self.exported.len().max(1))
            .cloned()
        else {
            return Ok(());
        };
        self.cancel(seq);
        let len = tokens.len();
        let mut tokens = tokens;
        tokens.push(next);
        let vals = codes(&tokens);
        let got = self.cache.import_parts(seq, &[window.clone(), global]);
        let want = self.model.import(seq, window.kv.start() as Pos, &vals[..len]);
        match (got, want) {
            (Ok(()), Ok(())) => {}
            (Err(CacheError::Full { .. }), Err(())) => return Ok(()),
            (got, want) => {
                return Err(TestCaseError::fail(format!(
                    "an import of {len}: the cache says {got:?}, the model {want:?}"
                )))
            }
        }
        self.compare()?;
        if let Some((cut, dst)) = fork.filter(|&(_, dst)| dst != seq) {
            let cut = 1 + usize::from(cut) * len / 256;
            self.fork(seq, dst, &tokens[..cut], next)?;
        }
        self.next_token(seq, len, &vals)?;
        self.cancel(seq);
        Ok(())
    }

    /// Writes the pass's values in both layers, then checks what each token
    /// sees in each group: its window (group 0) or everything (group 1)
    /// before it, with the values its own tokens give.
    fn put_and_check(&mut self, seq: SeqId, at: usize, vals: &[f32], n: usize) -> Result<(), TestCaseError> {
        let device = common::device();
        for layer in 0..2 {
            self.cache.set_layer(layer);
            let kv = filled(&vals[at..at + n], 1, 2, DType::F32, &device);
            self.cache.put(&kv, &kv).unwrap();
        }
        let tokens: Vec<(SeqId, Pos)> = (at..at + n).map(|p| (seq, p as Pos)).collect();
        for layer in 0..2 {
            self.cache.set_layer(layer);
            let seen = sees(&self.cache.groups()[layer], &tokens);
            for (i, row) in seen.iter().enumerate() {
                let p = at + i;
                let lo = if layer == 0 {
                    (p + 1).saturating_sub(self.setup.window)
                } else {
                    0
                };
                let want: Vec<(Pos, f32, f32)> = (lo..=p).map(|q| (q as Pos, vals[q], vals[q])).collect();
                prop_assert_eq!(row, &want, "layer {} at position {}", layer, p);
            }
        }
        Ok(())
    }

    fn evict(&mut self, short: u8) -> Result<(), TestCaseError> {
        let cells = self.setup.capacity.saturating_sub(usize::from(short));
        let got = self.cache.evict_blocks(cells);
        let mut want = Vec::new();
        let global = self.model.global();
        for (g, group) in self.model.groups.iter_mut().enumerate() {
            let (plan, _) = group.eviction_plan(cells);
            for key in &plan {
                group.blocks.remove(key);
            }
            if g == global {
                want = plan;
            }
        }
        self.model.settle();
        prop_assert_eq!(got, want, "blocks evicted");
        Ok(())
    }

    fn forget(&mut self, pick: u8) -> Result<(), TestCaseError> {
        let global = self.model.global();
        let blocks = &self.model.groups[global].blocks;
        let Some(&key) = blocks.keys().nth(usize::from(pick) % blocks.len().max(1)) else {
            return Ok(());
        };
        let mut got = self.cache.forget_blocks(&[key]);
        got.sort();
        let mut want = self.model.groups[global].forget(&key);
        want.sort();
        self.model.settle();
        prop_assert_eq!(got, want, "blocks forgotten");
        Ok(())
    }

    fn age(&mut self) -> Result<(), TestCaseError> {
        let mut got = self.cache.forget_blocks_unused_for(std::time::Duration::ZERO);
        got.sort();
        let want: Vec<BlockKey> = self.model.groups[self.model.global()]
            .blocks
            .keys()
            .copied()
            .collect();
        for g in &mut self.model.groups {
            g.blocks.clear();
        }
        self.model.settle();
        prop_assert_eq!(got, want, "blocks aged out");
        Ok(())
    }

    fn bad_adopt(&mut self, pick: u8, back: u8) -> Result<(), TestCaseError> {
        let Some(&(last, end)) = self
            .model
            .ends
            .iter()
            .map(|(k, e)| (k, e.len))
            .collect::<Vec<_>>()
            .get(usize::from(pick) % self.model.ends.len().max(1))
        else {
            return Ok(());
        };
        // The end's chain, cut back so the window before it is gone.
        let mut keys = vec![*last];
        while let Some(b) = self.model.groups[self.model.global()]
            .blocks
            .get(keys.last().unwrap())
        {
            if b.parent.is_root() {
                break;
            }
            keys.push(b.parent);
        }
        keys.reverse();
        let spans = self.model.spans(&keys);
        let at = end - Pos::from(back) * self.setup.window as Pos;
        if at <= 0 || self.model.groups.iter().all(|g| g.covers(&keys, &spans, at)) {
            return Ok(());
        }
        let n = spans.partition_point(|s| s.0 < at);
        let seq = 0;
        self.cancel(seq);
        let before = self.cache.picture().unwrap();
        let err = self.cache.adopt_blocks(seq, &keys[..n], at).unwrap_err();
        prop_assert!(matches!(err, CacheError::InvalidArgument(_)), "{:?}", err);
        prop_assert!(
            self.cache.picture().unwrap() == before,
            "a refused adoption changed the cache"
        );
        Ok(())
    }

    fn compare(&mut self) -> Result<(), TestCaseError> {
        self.cache.check();
        self.cache.drain_block_changes();
        prop_assert_eq!(self.cache.kept_ends(), self.model.ends.len(), "ends kept");
        for (g, model) in self.model.groups.iter().enumerate() {
            let group = &self.cache.groups()[g];
            let pinned: usize = model.blocks.values().map(|b| b.entries.len()).sum();
            prop_assert_eq!(
                group.indexed_blocks(),
                (model.blocks.len(), pinned),
                "group {}'s blocks",
                g
            );
            for key in model.blocks.keys() {
                prop_assert!(group.holds_block(key), "group {} lacks block {:?}", g, key);
            }
            let mut want: Vec<(SeqId, Pos, f32, f32)> = model
                .seqs
                .iter()
                .enumerate()
                .flat_map(|(s, entries)| entries.iter().map(move |e| (s, e.pos, e.val, e.val)))
                .collect();
            want.sort_by(|a, b| a.partial_cmp(b).unwrap());
            prop_assert_eq!(contents(group, g), want, "group {}'s sequences", g);
        }
        // Every kept end resumes where the model says, with what it says.
        for tokens in self.history.iter().rev().take(4) {
            let (fp, ns) = scope_parts();
            let limit = tokens.len() - 1;
            prop_assert_eq!(
                self.cache.longest_prefix(Scope::new(&fp, &ns), tokens, limit),
                self.model.longest_prefix(tokens, limit),
                "a lookup of an earlier request"
            );
        }
        Ok(())
    }
}

fn run(setup: Setup, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut r = Run::new(setup);
    for op in ops {
        match op {
            Op::Request {
                seq,
                base,
                cut,
                extra,
                answer,
                chunk,
                keep,
                junction,
                shift,
            } => r.request(seq, base, cut, &extra, answer, chunk, keep, junction, shift)?,
            Op::Evict { short } => r.evict(short)?,
            Op::Forget { pick } => r.forget(pick)?,
            Op::Age => r.age()?,
            Op::BadAdopt { pick, back } => r.bad_adopt(pick, back)?,
            Op::Restore {
                pick,
                seq,
                next,
                fork,
            } => r.restore(pick, seq, next, fork)?,
        }
        r.compare()?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn schedules_match_the_model(setup in setup(), ops in prop::collection::vec(op(), 1..40)) {
        run(setup, ops)?;
    }
}

/// A conversation's next turn resumes from its last turn's end through
/// both groups, and replaces that end: one tail per conversation.
#[test]
fn a_conversation_keeps_one_end() {
    let setup = Setup {
        capacity: 24,
        window: 3,
        memory: 6,
        block: 2,
        kept: 40,
    };
    let mut r = Run::new(setup);
    let first: Vec<u32> = vec![1, 2, 0, 1, 2, 2, 0];
    r.request(0, 0, 0, &first, 2, 4, true, None, None).unwrap();
    r.compare().unwrap();
    assert_eq!(r.cache.kept_ends(), 1);
    let turn = r.history[0].clone();
    let (fp, ns) = scope_parts();
    let mut next = turn.clone();
    next.extend([2, 1, 7]);
    let found = r
        .cache
        .longest_prefix(Scope::new(&fp, &ns), &next, next.len() - 1);
    assert_eq!(found.len, turn.len(), "the whole last turn resumes");
    // The next turn: the first one whole, then more.
    r.request(1, 0, turn.len() as u8, &[2, 1], 1, 3, true, None, None)
        .unwrap();
    r.compare().unwrap();
    assert_eq!(r.cache.kept_ends(), 1, "the new end replaced the old one");
    let window_cells = r.cache.groups()[0].indexed_blocks().1;
    assert!(
        window_cells <= 6 + 1,
        "the window group keeps one tail within its memory, not {window_cells} cells"
    );
}

/// A sequence's parts, exported for a prefix store (the global group every
/// position, the window group the tail it keeps) and imported into another
/// sequence, resume as the computed sequence would: the next token sees
/// exactly its window and its whole history. Parts that do not fit are
/// refused and change nothing.
#[test]
fn exported_parts_import_into_another_sequence_and_resume_there() {
    let setup = Setup {
        capacity: 40,
        window: 3,
        memory: 6,
        block: 2,
        kept: 0,
    };
    let mut r = Run::new(setup);
    r.cache.set_fingerprint(Fingerprint([9; 32]));
    let tokens: Vec<u32> = vec![1, 2, 0, 1, 2, 2, 0, 1, 1, 0, 2, 1, 7];
    let vals = codes(&tokens);
    let len = tokens.len() - 1; // the last token is evaluated after the import
    for at in (0..len).step_by(4) {
        let n = 4.min(len - at);
        r.cache
            .start_forward(&Batch::sequence(0, at as Pos, n).unwrap(), ForwardMode::Compute)
            .unwrap();
        r.put_and_check(0, at, &vals, n).unwrap();
    }
    let parts = r.cache.store_parts();
    assert_eq!(
        (parts[0].window, parts[0].memory, parts[1].window),
        (Some(3), Some(6), None)
    );
    assert_ne!(
        parts[0].fingerprint(Fingerprint([9; 32])),
        parts[1].fingerprint(Fingerprint([9; 32]))
    );
    let first = parts[0].first_kept(len);
    assert_eq!(first, len - 5);
    let window = r.cache.export_part(0, 0, first as Pos..len as Pos).unwrap();
    let global = r.cache.export_part(1, 0, 0..len as Pos).unwrap();
    // Below its memory the window group holds nothing to export.
    assert!(r.cache.export_part(0, 0, 0..len as Pos).is_err());
    r.cancel(0);

    let before = r.cache.picture().unwrap();
    let gone = r.cache.export_part(1, 0, 0..1).map(|_| ()).unwrap_err();
    assert!(matches!(gone, CacheError::InvalidArgument(_)), "{gone:?}");
    let slice = |state: &kvcache_api::SeqKv, range: std::ops::Range<usize>| kvcache_api::SeqKv {
        fingerprint: state.fingerprint,
        kv: state.kv.slice(range).unwrap(),
    };
    let refused = [
        // One part for two groups.
        vec![global.clone()],
        // Parts ending apart.
        vec![slice(&window, first..len - 1), global.clone()],
        // A window part starting after what a query at the end needs.
        vec![slice(&window, len - 1..len), global.clone()],
        // A global part not from 0 into an empty sequence.
        vec![window.clone(), slice(&global, 2..len)],
        // The parts swapped: each another part's fingerprint.
        vec![slice(&global, first..len), slice(&window, first..len)],
    ];
    for (i, parts) in refused.iter().enumerate() {
        let err = r.cache.import_parts(2, parts).unwrap_err();
        assert!(
            matches!(
                err,
                CacheError::InvalidArgument(_) | CacheError::LayoutMismatch { .. }
            ),
            "case {i}: {err:?}"
        );
        assert!(
            r.cache.picture().unwrap() == before,
            "a refused import changed the cache"
        );
    }

    r.cache
        .import_parts(2, &[window.clone(), global.clone()])
        .unwrap();
    r.cache.check();
    assert_eq!(r.cache.export_part(1, 2, 0..len as Pos).unwrap(), global);
    assert_eq!(
        r.cache.export_part(0, 2, first as Pos..len as Pos).unwrap(),
        window
    );
    // The prompt's last token, evaluated after the import: its window and
    // its whole history, with the values the tokens give.
    r.cache
        .start_forward(&Batch::sequence(2, len as Pos, 1).unwrap(), ForwardMode::Compute)
        .unwrap();
    r.put_and_check(2, len, &vals, 1).unwrap();
    r.cache.check();
}
