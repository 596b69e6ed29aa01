//! The [`Tier`] trait every level of the store implements (host memory, local
//! directory, Redis), the [`Block`] they hold and the [`TierContext`] they are
//! built for.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use kvcache_api::{Fingerprint, HostKv, KvLayout, Namespace};

use crate::error::Result;
use crate::keys::BlockKey;
use crate::stats::{TierCounters, TierStats};

/// What every tier of one store agrees on: the model, its layout and the block
/// size. Tiers are built for a context and the store checks that they match its
/// own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierContext {
    /// The model's fingerprint.
    pub fingerprint: Fingerprint,
    /// The layout of every block.
    pub layout: KvLayout,
    /// Tokens per full block; a block with fewer is a tail.
    pub block_tokens: usize,
}

/// One stored block: the keys and values of token offsets
/// `[kv.start(), kv.end())` of one prompt, with the keys that place it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// This block's key.
    pub key: BlockKey,
    /// The key of the block before it, [`BlockKey::ROOT`] for the first.
    pub parent: BlockKey,
    /// The namespace it belongs to.
    pub namespace: Namespace,
    /// Its keys and values; `kv.start()` is a multiple of the block size.
    pub kv: HostKv,
}

impl Block {
    /// Bytes of keys and values held.
    pub fn bytes(&self) -> u64 {
        self.kv.as_bytes().len() as u64
    }

    /// Whether this is a tail (shorter than a full block of `ctx`).
    pub fn is_tail(&self, ctx: &TierContext) -> bool {
        self.kv.tokens() < ctx.block_tokens
    }
}

/// A block still inside a submitted run: its keys and the token offsets of the
/// run it covers. [`Tier::put_run`] stores such blocks; tiers that write bytes
/// out (the disk tier) take them straight from the run, without a block of
/// their own in memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunBlock {
    /// This block's key.
    pub key: BlockKey,
    /// The key of the block before it, [`BlockKey::ROOT`] for the first.
    pub parent: BlockKey,
    /// The namespace it belongs to.
    pub namespace: Namespace,
    /// The token offsets it covers, within the run; `start` is a multiple of
    /// the block size.
    pub range: Range<usize>,
}

impl RunBlock {
    /// The block itself, its bytes copied out of `run` (shared when it is the
    /// whole run). A range outside the run (or empty) is
    /// [`StoreError::Corrupt`](crate::StoreError::Corrupt).
    pub fn to_block(&self, run: &HostKv) -> Result<Block> {
        let within = run.start() <= self.range.start
            && self.range.start < self.range.end
            && self.range.end <= run.end();
        if !within {
            return Err(crate::StoreError::Corrupt(format!(
                "a block of tokens {:?} outside the run {:?}",
                self.range,
                run.range()
            )));
        }
        let kv = if run.range() == self.range {
            run.clone()
        } else {
            crate::rows::join(run.layout(), &[run], self.range.clone())?
        };
        Ok(Block {
            key: self.key,
            parent: self.parent,
            namespace: self.namespace.clone(),
            kv,
        })
    }
}

/// One level of the store. Implementations are internally synchronised: the
/// store calls them from the writer thread and from every fetching thread.
///
/// A `get` answers `Ok(None)` for a miss, which includes a damaged entry (the
/// tier removes it and counts it in [`TierCounters::corrupt`]) and an entry of
/// another namespace; `Err` only for failures to ask (I/O, connection, deadline).
pub trait Tier: Send + Sync {
    /// A short name for statistics (`memory`, `disk`, `redis`).
    fn name(&self) -> &'static str;

    /// The model, layout and block size this tier was built for.
    fn context(&self) -> &TierContext;

    /// The block `key` of `namespace`, if held.
    fn get(&self, namespace: &Namespace, key: &BlockKey, deadline: Instant) -> Result<Option<Arc<Block>>>;

    /// Stores `block` (replacing an entry of the same key), evicting what the
    /// budget requires.
    fn put(&self, block: &Arc<Block>, deadline: Instant) -> Result<()>;

    /// Stores several blocks (those of one submitted run), as one batch where
    /// the tier gains by it (the disk tier syncs its directory once). An error
    /// may leave some of them stored.
    fn put_many(&self, blocks: &[Arc<Block>], deadline: Instant) -> Result<()> {
        blocks.iter().try_for_each(|block| self.put(block, deadline))
    }

    /// Whether [`put_run`](Self::put_run) writes straight from the run (as the
    /// disk tier does). The store then hands it the run as submitted; other
    /// tiers get the blocks cut once, in memory, and shared
    /// ([`put_many`](Self::put_many)).
    fn writes_runs(&self) -> bool {
        false
    }

    /// Stores the `blocks` of the submitted `run` (token ranges within it), as
    /// [`put_many`](Self::put_many) stores whole blocks; the default cuts each
    /// block out of the run (a copy) and calls it. A range outside the run is
    /// [`StoreError::Corrupt`](crate::StoreError::Corrupt), and nothing is
    /// stored.
    fn put_run(&self, run: &HostKv, blocks: &[RunBlock], deadline: Instant) -> Result<()> {
        let blocks = blocks
            .iter()
            .map(|block| block.to_block(run).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        self.put_many(&blocks, deadline)
    }

    /// Whether the block `key` of `namespace` is held (without reading it).
    fn contains(&self, namespace: &Namespace, key: &BlockKey, deadline: Instant) -> Result<bool>;

    /// Removes the block `key` of `namespace` if held.
    fn remove(&self, namespace: &Namespace, key: &BlockKey, deadline: Instant) -> Result<()>;

    /// Lengths of the tails stored after `parent` in `namespace`, shortest first.
    fn tails(&self, namespace: &Namespace, parent: &BlockKey, deadline: Instant) -> Result<Vec<usize>>;

    /// Bytes in use (for Redis, the server's `used_memory`).
    fn used_bytes(&self) -> Result<u64>;

    /// The tier's own byte budget; `None` where the backend manages its memory
    /// (Redis: `maxmemory`).
    fn budget(&self) -> Option<u64>;

    /// Entries held, where the tier keeps count.
    fn entries(&self) -> Option<u64>;

    /// Whether the block `key` of `namespace` is held, if the tier can tell
    /// without I/O (`None`, the default, where it cannot, as Redis). A store
    /// whose tiers all can plans a fetch before reading, and assembles the
    /// answer straight from [`open_rows`](Self::open_rows) readers.
    fn holds(&self, namespace: &Namespace, key: &BlockKey) -> Option<bool> {
        let _ = (namespace, key);
        None
    }

    /// A reader of the block `key`'s canonical bytes in order, and the token
    /// range it holds; `None` for a miss (or where the tier has no readers: the
    /// default). A damaged entry found on the way is removed and counted, as by
    /// [`get`](Self::get).
    fn open_rows(&self, namespace: &Namespace, key: &BlockKey, deadline: Instant) -> Result<OpenRows<'_>> {
        let _ = (namespace, key, deadline);
        Ok(None)
    }

    /// Whether blocks found in slower tiers are copied into this one on the
    /// fetching thread (true for cheap, in-memory tiers).
    fn promotes(&self) -> bool {
        false
    }

    /// The tier's live counters.
    fn counters(&self) -> &TierCounters;

    /// A snapshot of the counters and usage.
    fn stats(&self) -> TierStats {
        self.counters()
            .snapshot(self.name(), self.used_bytes().ok(), self.budget(), self.entries())
    }
}

/// What [`Tier::open_rows`] finds: the token range the block holds and a
/// reader of its bytes.
pub type OpenRows<'a> = Option<(Range<usize>, Box<dyn RowReader + 'a>)>;

/// A block's canonical bytes (layer by layer: keys head by head, then values
/// head by head), streamed in order, so that a fetch can place each head's rows
/// straight into its answer.
pub trait RowReader {
    /// Appends the next `len` bytes to `out`. A short entry is
    /// [`StoreError::Corrupt`](crate::StoreError::Corrupt).
    fn read_to(&mut self, len: usize, out: &mut Vec<u8>) -> Result<()>;

    /// Consumes the next `len` bytes without keeping them.
    fn skip(&mut self, len: usize) -> Result<()>;

    /// After every byte was consumed: whether the block checked out (its
    /// checksum). A tier that finds it damaged removes and counts it.
    fn finish(self: Box<Self>) -> Result<bool>;
}

/// A [`RowReader`] over bytes in memory.
#[derive(Debug)]
pub(crate) struct SliceRows<'a> {
    pub(crate) bytes: &'a [u8],
}

impl RowReader for SliceRows<'_> {
    fn read_to(&mut self, len: usize, out: &mut Vec<u8>) -> Result<()> {
        let (head, rest) = self
            .bytes
            .split_at_checked(len)
            .ok_or_else(|| crate::StoreError::Corrupt("read past the end of a block".into()))?;
        out.extend_from_slice(head);
        self.bytes = rest;
        Ok(())
    }

    fn skip(&mut self, len: usize) -> Result<()> {
        self.bytes = self
            .bytes
            .get(len..)
            .ok_or_else(|| crate::StoreError::Corrupt("skipped past the end of a block".into()))?;
        Ok(())
    }

    fn finish(self: Box<Self>) -> Result<bool> {
        Ok(self.bytes.is_empty())
    }
}
