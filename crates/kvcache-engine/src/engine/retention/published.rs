//! The blocks a cache without a block index reports to a router: the full
//! blocks of the finished sequences it keeps whole (idle sequences, as
//! Gemma 3's layer-group cache keeps them), counted across sequences.
//!
//! Two kept sequences that share a prefix hold its blocks once as far as a
//! router is told: a block is reported stored when the first sequence comes
//! to hold it and removed when the last one lets go. Along one sequence's
//! chain the held blocks are a prefix (a sequence holds a block only with
//! every block before it), so what one sequence adds is a run after a held
//! parent and what it drops is a run at its chain's end. Plain bookkeeping:
//! names in, events out.

use std::collections::HashMap;

use kvcache_api::events::EventBatch;
use kvcache_api::{Namespace, SeqId};

/// Which sequence holds which reported blocks, and how many hold each.
#[derive(Debug, Default)]
pub(super) struct PublishedBlocks {
    /// Per sequence id: the names of the blocks it holds, in chain order.
    held: Vec<Vec<u64>>,
    /// Per block name: how many sequences hold it (never 0).
    refs: HashMap<u64, usize>,
}

impl PublishedBlocks {
    /// Sequence `seq` now holds the blocks `names` (the chain of `tokens`,
    /// [`EventBatch::block_size`] tokens each, from position 0) instead of
    /// what it held before. Adds to `events` the blocks no sequence held
    /// before, stored, then the ones no sequence holds any more, removed.
    pub fn hold(
        &mut self,
        seq: SeqId,
        names: Vec<u64>,
        tokens: &[u32],
        namespace: &Namespace,
        events: &mut EventBatch,
    ) {
        debug_assert!(
            tokens.len() >= names.len() * events.block_size(),
            "every named block has its tokens"
        );
        if self.held.len() <= seq {
            self.held.resize_with(seq + 1, Vec::new);
        }
        let first_new = names.iter().take_while(|n| self.refs.contains_key(n)).count();
        for name in &names {
            *self.refs.entry(*name).or_insert(0) += 1;
        }
        events.stored(&names, first_new, tokens, namespace);
        let old = std::mem::replace(&mut self.held[seq], names);
        self.let_go(old, events);
    }

    /// Sequence `seq` keeps only its first `keep` blocks (its cells past
    /// them were removed or moved). Adds to `events` the removal of the
    /// blocks no sequence holds any more.
    pub fn release(&mut self, seq: SeqId, keep: usize, events: &mut EventBatch) {
        let Some(held) = self.held.get_mut(seq) else {
            return;
        };
        let dropped = held.split_off(keep.min(held.len()));
        self.let_go(dropped, events);
    }

    /// How many sequences hold block `name`.
    #[cfg(test)]
    fn holders(&self, name: u64) -> usize {
        self.refs.get(&name).copied().unwrap_or(0)
    }

    /// Drops one hold on each of `names`; the ones left with none, removed.
    fn let_go(&mut self, names: Vec<u64>, events: &mut EventBatch) {
        // Children first, so a router never holds a block whose parent is gone.
        for name in names.into_iter().rev() {
            let count = self.refs.get_mut(&name).expect("a held block is counted");
            *count -= 1;
            if *count == 0 {
                self.refs.remove(&name);
                events.removed(name);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvcache_api::events::{KvEvent, Medium};

    fn hold(
        p: &mut PublishedBlocks,
        seq: SeqId,
        names: Vec<u64>,
        tokens: &[u32],
        ns: &Namespace,
    ) -> Vec<KvEvent> {
        let mut events = EventBatch::new(2, Medium::Device);
        p.hold(seq, names, tokens, ns, &mut events);
        events.into_events()
    }

    fn release(p: &mut PublishedBlocks, seq: SeqId, keep: usize) -> Vec<KvEvent> {
        let mut events = EventBatch::new(2, Medium::Device);
        p.release(seq, keep, &mut events);
        events.into_events()
    }

    fn stored(events: &[KvEvent]) -> Vec<(Vec<u64>, Option<u64>, Vec<u32>)> {
        events
            .iter()
            .filter_map(|e| match e {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    ..
                } => Some((block_hashes.clone(), *parent_block_hash, token_ids.clone())),
                _ => None,
            })
            .collect()
    }

    fn removed(events: &[KvEvent]) -> Vec<u64> {
        events
            .iter()
            .flat_map(|e| match e {
                KvEvent::BlockRemoved { block_hashes, .. } => block_hashes.clone(),
                _ => Vec::new(),
            })
            .collect()
    }

    #[test]
    fn shared_prefixes_are_reported_once_and_removed_with_their_last_holder() {
        let ns = Namespace::shared();
        let mut p = PublishedBlocks::default();
        // Sequence 0 keeps 3 blocks of 2 tokens (and a 1-token tail).
        let a = [1, 2, 3, 4, 5, 6, 7];
        let events = hold(&mut p, 0, vec![10, 11, 12], &a, &ns);
        assert_eq!(
            stored(&events),
            [(vec![10, 11, 12], None, vec![1, 2, 3, 4, 5, 6])]
        );
        assert!(removed(&events).is_empty());
        // Sequence 1 shares the first two blocks: only its third is new.
        let b = [1, 2, 3, 4, 8, 9];
        let events = hold(&mut p, 1, vec![10, 11, 13], &b, &ns);
        assert_eq!(stored(&events), [(vec![13], Some(11), vec![8, 9])]);
        assert_eq!((p.holders(10), p.holders(12), p.holders(13)), (2, 1, 1));
        // Sequence 0 goes: its own block goes, the shared ones stay.
        assert_eq!(removed(&release(&mut p, 0, 0)), [12]);
        assert_eq!(p.holders(10), 1);
        // Sequence 1 keeps its first block only (the rest of its cells moved).
        assert_eq!(removed(&release(&mut p, 1, 1)), [13, 11]);
        assert_eq!(removed(&release(&mut p, 1, 0)), [10]);
        assert!(p.refs.is_empty());
        // Releasing what is not held reports nothing.
        assert!(release(&mut p, 5, 0).is_empty());
    }

    #[test]
    fn holding_anew_replaces_what_the_sequence_held() {
        let ns = Namespace::shared();
        let mut p = PublishedBlocks::default();
        hold(&mut p, 0, vec![10, 11], &[1, 2, 3, 4], &ns);
        // The next turn of the conversation, in the same sequence: the prefix
        // stays reported, the block after it that changed is replaced.
        let events = hold(&mut p, 0, vec![10, 14, 15], &[1, 2, 5, 6, 7, 8], &ns);
        assert_eq!(stored(&events), [(vec![14, 15], Some(10), vec![5, 6, 7, 8])]);
        assert_eq!(removed(&events), [11]);
        assert_eq!((p.holders(10), p.holders(11)), (1, 0));
    }
}
