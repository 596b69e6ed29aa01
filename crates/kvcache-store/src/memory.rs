//! The host-memory tier: a map of blocks and an LRU order under a byte budget.
//! Blocks are shared (`Arc`), so a put or a promotion copies nothing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use kvcache_api::Namespace;

use crate::error::Result;
use crate::keys::BlockKey;
use crate::lru::Lru;
use crate::stats::{bump, TierCounters};
use crate::tails::TailsIndex;
use crate::tier::{Block, OpenRows, RowReader, SliceRows, Tier, TierContext};

/// Blocks in host memory, least recently used evicted first beyond a byte
/// budget.
#[derive(Debug)]
pub struct MemoryTier {
    context: TierContext,
    budget: u64,
    inner: Mutex<Inner>,
    counters: TierCounters,
}

#[derive(Debug)]
struct Inner {
    blocks: HashMap<BlockKey, Arc<Block>>,
    lru: Lru<BlockKey>,
    tails: TailsIndex,
}

impl MemoryTier {
    /// An empty tier holding at most `budget` bytes of keys and values.
    pub fn new(context: TierContext, budget: u64) -> Self {
        MemoryTier {
            context,
            budget,
            inner: Mutex::new(Inner {
                blocks: HashMap::new(),
                lru: Lru::new(),
                tails: TailsIndex::default(),
            }),
            counters: TierCounters::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // The map stays consistent at every await-free step: a panic elsewhere
        // cannot leave it half-updated, so a poisoned lock is still usable.
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Inner {
    fn remove(&mut self, key: &BlockKey, context: &TierContext) -> bool {
        self.lru.remove(key);
        match self.blocks.remove(key) {
            Some(block) => {
                if block.is_tail(context) {
                    self.tails
                        .remove(&block.namespace, block.parent, block.kv.tokens());
                }
                true
            }
            None => false,
        }
    }
}

impl Tier for MemoryTier {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn context(&self) -> &TierContext {
        &self.context
    }

    fn get(&self, namespace: &Namespace, key: &BlockKey, _deadline: Instant) -> Result<Option<Arc<Block>>> {
        let mut inner = self.lock();
        match inner.blocks.get(key) {
            Some(block) if block.namespace == *namespace => {
                let block = Arc::clone(block);
                inner.lru.touch(key);
                Ok(Some(block))
            }
            _ => Ok(None),
        }
    }

    fn put(&self, block: &Arc<Block>, _deadline: Instant) -> Result<()> {
        let size = block.bytes();
        let mut inner = self.lock();
        inner.remove(&block.key, &self.context);
        if size > self.budget {
            return Ok(());
        }
        while inner.lru.total() + size > self.budget {
            let Some((oldest, _)) = inner.lru.pop_oldest() else {
                break;
            };
            inner.remove(&oldest, &self.context);
            bump(&self.counters.evictions);
        }
        if block.is_tail(&self.context) {
            inner.tails.add(&block.namespace, block.parent, block.kv.tokens());
        }
        inner.lru.insert(block.key, size);
        inner.blocks.insert(block.key, Arc::clone(block));
        Ok(())
    }

    fn contains(&self, namespace: &Namespace, key: &BlockKey, _deadline: Instant) -> Result<bool> {
        let inner = self.lock();
        Ok(inner.blocks.get(key).is_some_and(|b| b.namespace == *namespace))
    }

    fn remove(&self, namespace: &Namespace, key: &BlockKey, _deadline: Instant) -> Result<()> {
        let mut inner = self.lock();
        if inner.blocks.get(key).is_some_and(|b| b.namespace == *namespace) {
            inner.remove(key, &self.context);
        }
        Ok(())
    }

    fn tails(&self, namespace: &Namespace, parent: &BlockKey, _deadline: Instant) -> Result<Vec<usize>> {
        Ok(self.lock().tails.get(namespace, *parent))
    }

    fn used_bytes(&self) -> Result<u64> {
        Ok(self.lock().lru.total())
    }

    fn budget(&self) -> Option<u64> {
        Some(self.budget)
    }

    fn entries(&self) -> Option<u64> {
        Some(self.lock().lru.len() as u64)
    }

    fn promotes(&self) -> bool {
        true
    }

    fn holds(&self, namespace: &Namespace, key: &BlockKey) -> Option<bool> {
        let inner = self.lock();
        Some(inner.blocks.get(key).is_some_and(|b| b.namespace == *namespace))
    }

    fn open_rows(&self, namespace: &Namespace, key: &BlockKey, deadline: Instant) -> Result<OpenRows<'_>> {
        let Some(block) = self.get(namespace, key, deadline)? else {
            return Ok(None);
        };
        Ok(Some((block.kv.range(), Box::new(ArcRows { block, at: 0 }))))
    }

    fn counters(&self) -> &TierCounters {
        &self.counters
    }
}

/// A [`RowReader`] over a shared block.
struct ArcRows {
    block: Arc<Block>,
    at: usize,
}

impl ArcRows {
    fn rest(&self) -> SliceRows<'_> {
        SliceRows {
            bytes: &self.block.kv.as_bytes()[self.at.min(self.block.kv.as_bytes().len())..],
        }
    }
}

impl RowReader for ArcRows {
    fn read_to(&mut self, len: usize, out: &mut Vec<u8>) -> Result<()> {
        self.rest().read_to(len, out)?;
        self.at += len;
        Ok(())
    }

    fn skip(&mut self, len: usize) -> Result<()> {
        self.rest().skip(len)?;
        self.at += len;
        Ok(())
    }

    fn finish(self: Box<Self>) -> Result<bool> {
        Ok(self.at == self.block.kv.as_bytes().len())
    }
}
