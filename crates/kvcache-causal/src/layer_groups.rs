//! [`LayerGroupCache`]: one causal cache per group of layers, driven as one.
//!
//! Models such as Gemma 3 interleave sliding-window layers with global layers; each
//! kind needs its own cache (different windows, sizes and masks) but every forward
//! pass and every sequence edit must reach all of them. Operations are two-phase:
//! every group validates (and computes anything fallible, such as re-rotated keys)
//! before any group changes, so an error leaves every group as it was.
//!
//! **Blocks by group.** With a group without a window (the *global* group),
//! the cache keeps finished sequences by block as a single causal cache does:
//! the global group keeps each chain whole, and each window group keeps only
//! the chain's tail within its window memory before the chain's end
//! ([`ends`]). A prompt resumes at the longest prefix every group can serve
//! (global: every block before it; window: the blocks over the window before
//! it), so the engine drives a Gemma-shaped model with the same retention
//! as a Llama.

mod ends;

use std::time::Duration;

use candle_core::Tensor;
use kvcache_api::block_key::{BlockKey, Scope};
use kvcache_api::retention::{BlockChain, BlockChange, Prefix};
use kvcache_api::{
    Batch, CacheError, CausalCache, CausalConfig, Fingerprint, ForwardMode, KvView, PagedKv, Pos, PosRange,
    Result, SeqId, SeqKv, StorePart,
};

use crate::book::Book;
use crate::cache::CausalKvCache;
use crate::inspect::CachePicture;
use ends::{End, Ends};

/// Several [`CausalKvCache`]s behind one [`CausalCache`], routed by layer.
///
/// `start_forward`, `set_causal`, `remove` and `copy_prefix` go to every group;
/// `put` and `get` go to the group of the current layer (layers keep their global
/// index inside each group, so a shift function sees the real layer number).
/// [`config`](CausalCache::config) is the configuration of the current layer's
/// group, and [`can_resume`](CausalCache::can_resume) holds when every group can
/// resume.
///
/// ```
/// use candle_core::Device;
/// use kvcache_api::{Batch, CausalCache, CausalConfig, ForwardMode, SlidingWindow};
/// use kvcache_causal::{CausalKvCache, LayerGroupCache};
///
/// let global = CausalConfig::new(1, 1024, 64);
/// let local = global.clone().with_window(SlidingWindow::new(128));
/// let groups = vec![
///     CausalKvCache::new(local, Device::Cpu, None)?,
///     CausalKvCache::new(global, Device::Cpu, None)?,
/// ];
/// // Gemma 3's pattern: five local layers, then one global layer.
/// let layers = (0..12).map(|l| if l % 6 == 5 { 1 } else { 0 }).collect();
/// let mut cache = LayerGroupCache::new(groups, layers)?;
/// cache.start_forward(&Batch::sequence(0, 0, 8)?, ForwardMode::Compute)?;
/// cache.set_layer(5);
/// assert_eq!(cache.config().window, None);
/// # Ok::<(), kvcache_api::CacheError>(())
/// ```
#[derive(Debug)]
pub struct LayerGroupCache {
    groups: Vec<CausalKvCache>,
    group_of_layer: Vec<usize>,
    layer: usize,
    /// The first group without a window: where whole chains are kept and
    /// looked up (`None`: every group has a window, and no block is kept).
    global: Option<usize>,
    /// The ends kept, and the window blocks each needs.
    ends: Ends,
    /// The model fingerprint (all zeros until set): each group carries its
    /// store part's ([`StorePart::fingerprint`]).
    fingerprint: Fingerprint,
}

impl LayerGroupCache {
    /// Groups `groups`, where layer `l` uses group `group_of_layer[l]`.
    pub fn new(groups: Vec<CausalKvCache>, group_of_layer: Vec<usize>) -> Result<Self> {
        if groups.is_empty() {
            return Err(CacheError::InvalidArgument(
                "a layer-group cache needs at least one group".into(),
            ));
        }
        if let Some((layer, &g)) = group_of_layer
            .iter()
            .enumerate()
            .find(|(_, &g)| g >= groups.len())
        {
            return Err(CacheError::InvalidArgument(format!(
                "layer {layer} maps to group {g}, but there are {} groups",
                groups.len()
            )));
        }
        Ok(LayerGroupCache {
            global: global_group(&groups),
            groups,
            group_of_layer,
            layer: 0,
            ends: Ends::default(),
            fingerprint: Fingerprint::default(),
        })
    }

    /// The caches, by group index.
    pub fn groups(&self) -> &[CausalKvCache] {
        &self.groups
    }

    /// Sets the model fingerprint: each group carries the fingerprint of
    /// its store part ([`StorePart::fingerprint`] of
    /// [`store_parts`](CausalCache::store_parts)), so a part's keys and
    /// values are imported only into the same part of the same model.
    /// [`configure_groups`](Self::configure_groups) keeps it.
    pub fn set_fingerprint(&mut self, fingerprint: Fingerprint) {
        self.fingerprint = fingerprint;
        for (g, part) in self.store_parts().into_iter().enumerate() {
            self.groups[g].set_fingerprint(part.fingerprint(fingerprint));
        }
    }

    /// The model fingerprint (all zeros until set).
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// The layers of group `g`, ascending.
    fn layers_of(&self, g: usize) -> Vec<usize> {
        (0..self.group_of_layer.len())
            .filter(|&l| self.group_of_layer[l] == g)
            .collect()
    }

    /// The group of `layer`, if it is mapped.
    pub fn group_of(&self, layer: usize) -> Option<usize> {
        self.group_of_layer.get(layer).copied()
    }

    /// Reconfigures every group (`configs[g]` for group `g`), all or nothing.
    pub fn configure_groups(&mut self, configs: Vec<CausalConfig>) -> Result<()> {
        if configs.len() != self.groups.len() {
            return Err(CacheError::InvalidArgument(format!(
                "{} configurations for {} groups",
                configs.len(),
                self.groups.len()
            )));
        }
        let fresh = self
            .groups
            .iter()
            .zip(configs)
            .map(|(group, config)| {
                CausalKvCache::with_shared_shift(
                    config,
                    group.device().clone(),
                    group.shared_shift().cloned(),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        self.global = global_group(&fresh);
        self.groups = fresh;
        self.ends.clear();
        let layer = self.layer;
        self.set_layer(layer);
        self.set_fingerprint(self.fingerprint);
        Ok(())
    }

    /// The cells row `row` of the current layer's mask may attend to: the
    /// current layer's group's [`CausalKvCache::visible_cells`] (mask columns of
    /// that group's pass range), with its errors; an
    /// [`InvalidArgument`](CacheError::InvalidArgument) error for a layer outside
    /// every group.
    pub fn visible_cells(&self, row: usize) -> Result<Vec<std::ops::Range<usize>>> {
        self.groups[self.current()?].visible_cells(row)
    }

    /// A picture of every group ([`CausalKvCache::picture`]).
    pub fn picture(&self) -> Result<Vec<CachePicture>> {
        self.groups.iter().map(CausalKvCache::picture).collect()
    }

    /// Prefix ends kept by block (see [`CausalCache::retain_blocks`]).
    pub fn kept_ends(&self) -> usize {
        self.ends.len()
    }

    /// Panics unless every group's invariants hold, and the kept ends agree
    /// with the groups: every end's blocks indexed, and every block of a
    /// window group kept for some end.
    pub fn check(&self) {
        for group in &self.groups {
            group.check();
        }
        let Some(global) = self.global else {
            assert_eq!(self.ends.len(), 0, "ends kept without a global group");
            return;
        };
        for (last, end) in self.ends.iter() {
            let b = self.groups[global]
                .book
                .blocks()
                .get(last)
                .unwrap_or_else(|| panic!("end {last:?}: its last block is not kept"));
            assert_eq!(b.end(), end.len, "end {last:?} is not where its last block ends");
            for (g, key) in &end.tails {
                assert!(
                    self.groups[*g].book.holds_block(key),
                    "end {last:?}: group {g} lost block {key:?}"
                );
            }
        }
        if self.groups.iter().any(|g| g.book.blocks().keeps_tails()) {
            for (key, _) in self.groups[global].book.blocks().iter() {
                let leaf = self.groups[global].book.block_children(key).is_empty();
                assert!(
                    !leaf || self.ends.get(key).is_some(),
                    "global block {key:?} leads to no kept end"
                );
            }
        }
        for (g, group) in self.groups.iter().enumerate() {
            if group.book.blocks().keeps_tails() {
                for (key, _) in group.book.blocks().iter() {
                    assert!(
                        self.ends.needs(g, key),
                        "group {g} keeps block {key:?} for no end"
                    );
                }
            }
        }
    }

    /// The longest part of `found` (a chain of the global group) that every
    /// group can resume after: its length is `found.len` or the end of one
    /// of its blocks.
    fn resumable(&self, global: usize, found: Prefix) -> Prefix {
        let spans = self.spans(global, &found.keys);
        let len = found.len as Pos;
        let candidates = std::iter::once(len).chain(spans.iter().rev().map(|s| s.1).filter(|&e| e < len));
        for at in candidates.filter(|&at| at > 0) {
            if self.groups.iter().all(|g| g.book.covers(&found.keys, &spans, at)) {
                let n = spans.partition_point(|s| s.0 < at);
                return Prefix {
                    keys: found.keys[..n].to_vec(),
                    len: at as usize,
                };
            }
        }
        Prefix::default()
    }

    /// Positions `start..end` of each of `keys` in the global group (empty
    /// from the first key it does not keep).
    fn spans(&self, global: usize, keys: &[BlockKey]) -> Vec<(Pos, Pos)> {
        let blocks = self.groups[global].book.blocks();
        keys.iter()
            .map_while(|k| blocks.get(k).map(|b| (b.start, b.end())))
            .collect()
    }

    /// Drops the ends a group lost a block of (after anything that may
    /// have removed blocks), and the window blocks only they needed.
    fn settle(&mut self) {
        let Some(global) = self.global else {
            return;
        };
        if !self.ends.removals_since(self.removed()) {
            return;
        }
        let groups = &self.groups;
        let broken = self.ends.broken(
            |g, key| groups[g].book.holds_block(key),
            |last| groups[global].book.holds_block(last),
        );
        for last in broken {
            self.release(&last);
        }
        self.prune_leaves();
        self.ends.removals_since(self.removed());
    }

    /// Blocks the groups' indexes removed, together, since they were made.
    fn removed(&self) -> u64 {
        self.groups.iter().map(|g| g.book.blocks().removed()).sum()
    }

    /// Stops keeping the end `last`, forgetting the window blocks only it
    /// needed and the global blocks that lead to no other end.
    fn release(&mut self, last: &BlockKey) {
        let Some((_, unneeded)) = self.ends.release(last) else {
            return;
        };
        for (g, key) in unneeded {
            self.groups[g].book.forget_blocks(&[key]);
        }
        self.prune(last);
    }

    /// Forgets the global blocks from `last` up its chain that lead to no
    /// kept end: no prompt can resume in them (with window groups, only an
    /// end's tail makes a prefix resumable), so they are not kept.
    fn prune(&mut self, last: &BlockKey) {
        let Some(global) = self.global else {
            return;
        };
        if self.groups.iter().all(|g| g.book.indexes_blocks()) {
            return; // no window group: every kept block is resumable
        }
        let book = &mut self.groups[global].book;
        let mut key = *last;
        while let Some(parent) = book.blocks().get(&key).map(|b| b.parent) {
            if self.ends.get(&key).is_some() || !book.block_children(&key).is_empty() {
                break;
            }
            book.forget_blocks(&[key]);
            key = parent;
        }
    }

    /// Prunes every global leaf that is no end (after blocks went in ways
    /// that left no end to prune from: a chain forgotten from its middle).
    fn prune_leaves(&mut self) {
        let Some(global) = self.global else {
            return;
        };
        let blocks = self.groups[global].book.blocks();
        let leaves: Vec<BlockKey> = blocks
            .iter()
            .map(|(key, _)| *key)
            .filter(|key| blocks.children(key).is_empty() && self.ends.get(key).is_none())
            .collect();
        for leaf in leaves {
            self.prune(&leaf);
        }
    }

    /// Runs `f` on every group's bookkeeping; returns what it returned for
    /// the global group (nothing without one, and then nothing runs).
    fn in_every_group<T: Default>(&mut self, mut f: impl FnMut(&mut Book) -> T) -> T {
        let Some(global) = self.global else {
            return T::default();
        };
        let mut out = T::default();
        for (g, group) in self.groups.iter_mut().enumerate() {
            let got = f(&mut group.book);
            if g == global {
                out = got;
            }
        }
        out
    }

    /// The global group, or the error for a cache without one.
    fn global(&self) -> Result<usize> {
        self.global.ok_or_else(|| {
            CacheError::NotSupported(
                "block retention in a layer-group cache whose every group has a window".into(),
            )
        })
    }

    fn current(&self) -> Result<usize> {
        self.group_of(self.layer).ok_or_else(|| {
            CacheError::InvalidArgument(format!(
                "layer {} belongs to no group ({} layers are mapped)",
                self.layer,
                self.group_of_layer.len()
            ))
        })
    }
}

/// The first group that keeps whole chains.
fn global_group(groups: &[CausalKvCache]) -> Option<usize> {
    groups.iter().position(|g| g.book.indexes_blocks())
}

impl CausalCache for LayerGroupCache {
    type Tensor = Tensor;

    fn config(&self) -> &CausalConfig {
        let group = self.current().unwrap_or(0);
        self.groups[group].config()
    }

    /// The cells of the current layer's group (the width of its masks and
    /// views), as [`config`](CausalCache::config) is that group's configuration;
    /// the first group's for a layer outside every group. Each group's own count
    /// is `groups()[g].num_cells()`.
    fn num_cells(&self) -> usize {
        let group = self.current().unwrap_or(0);
        self.groups[group].num_cells()
    }

    /// A single configuration cannot describe several groups: use
    /// [`LayerGroupCache::configure_groups`].
    fn configure(&mut self, _config: CausalConfig) -> Result<()> {
        Err(CacheError::NotSupported(
            "a layer-group cache has one configuration per group: use configure_groups".into(),
        ))
    }

    fn start_forward(&mut self, batch: &Batch, mode: ForwardMode) -> Result<()> {
        for group in &mut self.groups {
            group.prepare_forward(batch, mode)?;
        }
        let committed = self
            .groups
            .iter_mut()
            .try_for_each(|group| group.commit_forward(batch, mode));
        // A pass that lacked cells may have evicted blocks.
        self.settle();
        committed
    }

    fn set_layer(&mut self, layer: usize) {
        self.layer = layer;
        if let Some(g) = self.group_of(layer) {
            self.groups[g].set_layer(layer);
        }
    }

    fn set_causal(&mut self, except: &[usize]) -> Result<()> {
        let changed = self
            .groups
            .iter()
            .map(|g| g.prepare_set_causal(except))
            .collect::<Result<Vec<bool>>>()?;
        for (group, changed) in self.groups.iter_mut().zip(changed) {
            group.commit_set_causal(except, changed)?;
        }
        Ok(())
    }

    fn put(&mut self, keys: &Tensor, values: &Tensor) -> Result<()> {
        let g = self.current()?;
        self.groups[g].put(keys, values)
    }

    fn get(&self) -> Result<KvView<Tensor>> {
        self.groups[self.current()?].get()
    }

    fn get_paged(&self) -> Result<PagedKv<'_, Tensor>> {
        self.groups[self.current()?].get_paged()
    }

    fn copy_prefix(&mut self, src: SeqId, dst: SeqId, len: Pos) -> Result<()> {
        for group in &self.groups {
            group.prepare_copy_prefix(src, dst, len)?;
        }
        for group in &mut self.groups {
            group.commit_copy_prefix(src, dst, len);
        }
        Ok(())
    }

    fn can_resume(&self, seq: SeqId, pos: Pos) -> bool {
        self.groups.iter().all(|g| g.can_resume(seq, pos))
    }

    fn remove(&mut self, seq: SeqId, range: PosRange) -> Result<()> {
        let prepared = self
            .groups
            .iter()
            .map(|g| g.prepare_remove(seq, range))
            .collect::<Result<Vec<_>>>()?;
        if range.start <= 0 {
            self.ends.take_origins(seq);
        }
        let committed = self
            .groups
            .iter_mut()
            .zip(prepared)
            .try_for_each(|(group, prepared)| group.commit_remove(prepared));
        // A shifting removal forgets the blocks whose cells it moved.
        self.settle();
        committed
    }

    /// Yes with a group without a window (where whole chains are kept).
    fn indexes_blocks(&self) -> bool {
        self.global.is_some()
    }

    /// The global group's blocks.
    fn block_children(&self, parent: &BlockKey) -> Vec<(BlockKey, usize)> {
        self.global
            .map_or_else(Vec::new, |g| self.groups[g].book.block_children(parent))
    }

    /// Whether the global group keeps `key`.
    fn holds_block(&self, key: &BlockKey) -> bool {
        self.global.is_some_and(|g| self.groups[g].book.holds_block(key))
    }

    /// The global group's longest chain of `tokens`, cut back to where every
    /// window group holds the window before it.
    fn longest_prefix(&self, scope: Scope<'_>, tokens: &[u32], limit: usize) -> Prefix {
        let Some(global) = self.global else {
            return Prefix::default();
        };
        let found = self.groups[global].book.longest_prefix(scope, tokens, limit);
        self.resumable(global, found)
    }

    /// The global group's longest chain of `tokens`.
    fn held_prefix(&self, scope: Scope<'_>, tokens: &[u32], limit: usize) -> usize {
        self.global.map_or(0, |g| {
            self.groups[g].book.longest_prefix(scope, tokens, limit).len
        })
    }

    /// The global group keeps the whole chain; each window group the blocks
    /// within its window memory before the chain's end that `seq` holds
    /// whole. The end is kept (and resumable) when every window group keeps
    /// some. A finished sequence's end replaces an end `seq` resumed from
    /// within its last block; the end of a prefix of a sequence that goes on
    /// (a junction: later prompts share it, then part) is never replaced.
    /// Returns the indices of the blocks the global group newly indexed.
    fn retain_blocks(&mut self, seq: SeqId, chain: &BlockChain) -> Result<Vec<usize>> {
        let global = self.global()?;
        let plans = self
            .groups
            .iter()
            .map(|g| match g.book.indexes_blocks() {
                true => g.book.prepare_retain(seq, chain),
                false => g.book.prepare_retain_tail(seq, chain),
            })
            .collect::<Result<Vec<_>>>()?;
        let mut tails = Vec::new();
        let mut added = Vec::new();
        let mut every_window = true;
        for (g, plan) in plans.into_iter().enumerate() {
            let kept = plan.kept();
            let new = self.groups[g].book.commit_retain(chain, plan);
            if g == global {
                added = new;
            } else if self.groups[g].book.blocks().keeps_tails() {
                every_window &= !kept.is_empty();
                tails.extend(kept.map(|i| (g, chain.blocks()[i].0)));
            }
        }
        let Some(&(last, _)) = chain.blocks().last() else {
            return Ok(added);
        };
        let len = chain.tokens().len() as Pos;
        let junction = self.groups[global].book.cells().index(seq).last_pos() >= Some(len);
        let origins = if junction {
            Vec::new()
        } else {
            self.ends.take_origins(seq)
        };
        let end = End {
            len,
            junction,
            block: chain.blocks()[0].1 as Pos,
            tails,
        };
        let unneeded = if every_window {
            self.ends.insert(last, end)
        } else {
            // Not resumable: keep no tail for it.
            end.tails
                .into_iter()
                .filter(|(g, key)| !self.ends.needs(*g, key))
                .collect()
        };
        for (g, key) in unneeded {
            self.groups[g].book.forget_blocks(&[key]);
        }
        if !every_window {
            self.prune(&last);
        }
        for origin in origins.iter().filter(|&&o| o != last) {
            self.release(origin);
        }
        self.settle();
        Ok(added)
    }

    /// Adopts into every group what a query at `len` needs: the whole chain
    /// in the global group; in each window group the blocks it keeps within
    /// its window memory before `len` (at least those over the window).
    /// `blocks` and `len` must be resumable (as
    /// [`longest_prefix`](CausalCache::longest_prefix) finds them).
    fn adopt_blocks(&mut self, seq: SeqId, blocks: &[BlockKey], len: Pos) -> Result<()> {
        let global = self.global()?;
        let spans = self.spans(global, blocks);
        if spans.len() < blocks.len() || spans.last().is_none_or(|s| len <= s.0 || len > s.1) {
            return Err(CacheError::InvalidArgument(format!(
                "adopting {len} positions of a chain of {} blocks that the global group does not                  keep to that length",
                blocks.len()
            )));
        }
        let runs = self
            .groups
            .iter()
            .enumerate()
            .map(|(g, group)| {
                if !group.book.covers(blocks, &spans, len) {
                    return Err(CacheError::InvalidArgument(format!(
                        "group {g} cannot resume the chain at {len}: it lacks the window before it"
                    )));
                }
                let first = group.book.first_block_adopted(blocks, &spans, len);
                group.book.prepare_adopt(seq, &blocks[first..], len)?;
                Ok(first)
            })
            .collect::<Result<Vec<usize>>>()?;
        for (group, first) in self.groups.iter_mut().zip(&runs) {
            group.book.commit_adopt(seq, &blocks[*first..], len);
        }
        if let Some(g) = (0..self.groups.len()).find(|&g| self.groups[g].book.blocks().keeps_tails()) {
            let last = *blocks.last().expect("a chain");
            self.ends.resumed(seq, g, &last, len);
        }
        Ok(())
    }

    /// Forgets `keys` and what follows them in the global group, and the
    /// ends they held; returns what the global group forgot.
    fn forget_blocks(&mut self, keys: &[BlockKey]) -> Vec<BlockKey> {
        let Some(global) = self.global else {
            return Vec::new();
        };
        let gone = self.groups[global].book.forget_blocks(keys);
        self.settle();
        gone
    }

    /// Ages every group; returns what the global group forgot.
    fn forget_blocks_unused_for(&mut self, age: Duration) -> Vec<BlockKey> {
        let gone = self.in_every_group(|book| book.forget_blocks_unused_for(age));
        self.settle();
        gone
    }

    /// Evicts in every group until it has `cells` free cells; returns what
    /// the global group evicted.
    fn evict_blocks(&mut self, cells: usize) -> Vec<BlockKey> {
        let gone = self.in_every_group(|book| book.evict_blocks(cells));
        self.settle();
        gone
    }

    fn clear_blocks(&mut self) -> Vec<BlockKey> {
        let gone = self.in_every_group(Book::clear_blocks);
        self.ends.clear();
        gone
    }

    /// The global group's blocks, and the cells every group keeps for them.
    fn indexed_blocks(&self) -> (usize, usize) {
        let Some(global) = self.global else {
            return (0, 0);
        };
        let cells = self.groups.iter().map(|g| g.book.indexed_blocks().1).sum();
        (self.groups[global].book.indexed_blocks().0, cells)
    }

    /// The global group's changes (the window groups' are dropped: a window
    /// block is kept only as part of an end the global group names).
    fn drain_block_changes(&mut self) -> Vec<BlockChange> {
        self.in_every_group(Book::drain_block_changes)
    }

    /// One part per group, in group order: the group's layers, its window
    /// and its window memory.
    fn store_parts(&self) -> Vec<StorePart> {
        (0..self.groups.len())
            .map(|g| {
                let config = self.groups[g].config();
                StorePart::layers(
                    self.layers_of(g),
                    config.window.map(|w| w.window()),
                    config.effective_memory(),
                )
            })
            .collect()
    }

    /// Positions `range` of `seq` in group `part`'s layers; the group must
    /// hold every one (a window group holds its window memory before the
    /// sequence's next position).
    fn export_part(&self, part: usize, seq: SeqId, range: std::ops::Range<Pos>) -> Result<SeqKv> {
        let group = self.groups.get(part).ok_or_else(|| {
            CacheError::InvalidArgument(format!("part {part} of a cache of {} groups", self.groups.len()))
        })?;
        group.export_layers(seq, range, &self.layers_of(part))
    }

    /// The first position of `seq` that group `part` holds (0 when it holds
    /// none, or for a part or sequence beyond the cache's).
    fn part_start(&self, part: usize, seq: SeqId) -> Pos {
        self.groups
            .get(part)
            .filter(|group| seq < group.config().max_sequences)
            .and_then(|group| group.book.cells().index(seq).first_pos())
            .unwrap_or(0)
    }

    /// Imports one state per group, all ending at the same position `end`,
    /// into `seq`, all or nothing. In a group where `seq` is empty, the state
    /// must start where a query at `end` first needs the group (0 in the
    /// global group, at most `end - window + 1` in a window group);
    /// otherwise it must start where `seq` ends there.
    fn import_parts(&mut self, seq: SeqId, parts: &[SeqKv]) -> Result<()> {
        if parts.len() != self.groups.len() {
            return Err(CacheError::InvalidArgument(format!(
                "{} parts given to a cache of {} groups",
                parts.len(),
                self.groups.len()
            )));
        }
        let end = parts[0].kv.end();
        let store_parts = self.store_parts();
        for (g, (state, part)) in parts.iter().zip(&store_parts).enumerate() {
            if state.kv.end() != end {
                return Err(CacheError::InvalidArgument(format!(
                    "part {g} ends at {}, part 0 at {end}: the parts of an import end together",
                    state.kv.end()
                )));
            }
            let group = &self.groups[g];
            let empty = seq < group.config().max_sequences && group.book.cells().index(seq).is_empty();
            if empty && state.kv.start() > part.first_needed(end) {
                return Err(CacheError::InvalidArgument(format!(
                    "part {g} starts at {}: a query at {end} needs it from {}",
                    state.kv.start(),
                    part.first_needed(end)
                )));
            }
        }
        let mut prepared = Vec::with_capacity(parts.len());
        for (g, state) in parts.iter().enumerate() {
            let layers = self.layers_of(g);
            prepared.push(self.groups[g].prepare_import(seq, state, Some(&layers))?);
        }
        let committed = self
            .groups
            .iter_mut()
            .zip(prepared)
            .try_for_each(|(group, prepared)| group.commit_import(prepared));
        // An import trims sequences to their windows, as a pass does.
        self.settle();
        committed
    }
}
