//! The local-directory tier: one safetensors file per block (format in
//! [`entry_file`](crate::entry_file)), an in-memory index rebuilt from the file
//! headers at open, and an LRU order under a byte budget.
//!
//! Crash safety: a block is written to a temporary name (`.tmp-…`) in the same
//! directory, `sync_all`ed, renamed to `{key hex}.safetensors`, and the directory
//! is fsynced (once per group of up to 8 blocks of one [`Tier::put_many`],
//! whose files are synced side by side); a crash leaves either no entry or a
//! whole one, and temporary files left behind are removed at the next open.
//!
//! Writes copy nothing in memory: a block of a submitted run
//! ([`Tier::put_run`]) goes to its file straight from the run's rows (per
//! layer and head, the block's rows are one slice of the run; a vectored write
//! takes them all, and the CRC32 is computed over the same slices). The room a
//! group of files needs is made before it is written, and the files of the
//! entries it displaces are removed on a thread of their own meanwhile (still
//! before the put returns).
//!
//! A read checks the header against the store (model, layout, namespace, key),
//! the file length and the CRC32 of the data; a file that fails is a miss, is
//! removed, and is counted in [`TierCounters::corrupt`]. Reads come whole
//! ([`Tier::get`]) or as a [`RowReader`] that a planned fetch reads straight
//! into its answer, checksumming on the way.
//!
//! One process per directory: opening it removes temporary files, another live
//! writer's included.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{IoSlice, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime};

use kvcache_api::{HostKv, Namespace};

use crate::entry_file::{encode_header, read_header, Describe, Header};
use crate::error::{Result, StoreError};
use crate::keys::BlockKey;
use crate::lru::Lru;
use crate::rows;
use crate::stats::{bump, TierCounters};
use crate::tails::TailsIndex;
use crate::tier::{Block, OpenRows, RowReader, RunBlock, Tier, TierContext};

/// The file name suffix of entries.
const SUFFIX: &str = ".safetensors";
/// The file name prefix of files being written.
const TEMP_PREFIX: &str = ".tmp-";
/// Files written and synced together by one batch.
const SYNC_GROUP: usize = 8;
/// How stale a file's modification time may get before a read refreshes it.
const MTIME_RESOLUTION: std::time::Duration = std::time::Duration::from_secs(60);

/// Blocks as safetensors files in one directory, least recently used removed
/// first beyond a byte budget (counted in file bytes).
#[derive(Debug)]
pub struct DiskTier {
    context: TierContext,
    dir: PathBuf,
    budget: u64,
    inner: Mutex<Index>,
    temp_serial: AtomicU64,
    counters: TierCounters,
}

/// What the index knows of one file, from its header.
#[derive(Debug, Clone)]
struct Entry {
    namespace: Namespace,
    parent: BlockKey,
    tokens: usize,
}

#[derive(Debug)]
struct Index {
    entries: HashMap<BlockKey, Entry>,
    lru: Lru<BlockKey>,
    tails: TailsIndex,
}

impl Index {
    fn insert(&mut self, key: BlockKey, entry: Entry, size: u64, context: &TierContext) {
        self.forget(&key, context);
        if entry.tokens < context.block_tokens {
            self.tails.add(&entry.namespace, entry.parent, entry.tokens);
        }
        self.lru.insert(key, size);
        self.entries.insert(key, entry);
    }

    fn forget(&mut self, key: &BlockKey, context: &TierContext) -> bool {
        self.lru.remove(key);
        match self.entries.remove(key) {
            Some(entry) => {
                if entry.tokens < context.block_tokens {
                    self.tails.remove(&entry.namespace, entry.parent, entry.tokens);
                }
                true
            }
            None => false,
        }
    }
}

impl DiskTier {
    /// Opens (creating it if needed) the directory `dir` as a tier of at most
    /// `budget` bytes: removes leftover temporary files and damaged entries,
    /// indexes the entries of this context's model and layout from their headers
    /// (LRU order by modification time), and evicts down to the budget. Files of
    /// other models or layouts are left alone and not counted.
    pub fn open(context: TierContext, dir: impl Into<PathBuf>, budget: u64) -> Result<Self> {
        let dir = dir.into();
        fs::create_dir_all(&dir).map_err(|e| StoreError::io("create directory", &dir, e))?;
        let tier = DiskTier {
            context,
            dir,
            budget,
            inner: Mutex::new(Index {
                entries: HashMap::new(),
                lru: Lru::new(),
                tails: TailsIndex::default(),
            }),
            temp_serial: AtomicU64::new(0),
            counters: TierCounters::default(),
        };
        tier.scan()?;
        let victims = tier.evict_to_budget(&mut tier.lock());
        tier.remove_files(&victims);
        Ok(tier)
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of block `key`.
    pub fn path_of(&self, key: &BlockKey) -> PathBuf {
        self.dir.join(format!("{}{SUFFIX}", key.to_hex()))
    }

    /// The keys indexed, least recently used first.
    pub fn keys(&self) -> Vec<BlockKey> {
        self.lock().lru.keys().copied().collect()
    }

    fn lock(&self) -> MutexGuard<'_, Index> {
        // Every update of the index is complete before the lock is released.
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn scan(&self) -> Result<()> {
        let listing = fs::read_dir(&self.dir).map_err(|e| StoreError::io("list", &self.dir, e))?;
        let mut found = Vec::new();
        for item in listing {
            let item = item.map_err(|e| StoreError::io("list", &self.dir, e))?;
            let name = item.file_name();
            let Some(name) = name.to_str() else { continue };
            let path = item.path();
            if name.starts_with(TEMP_PREFIX) {
                let _ = fs::remove_file(&path);
                continue;
            }
            let Some(key) = name.strip_suffix(SUFFIX).and_then(BlockKey::from_hex) else {
                continue;
            };
            match self.read_index_entry(&path, &key) {
                Ok(Some((entry, size, modified))) => found.push((modified, key, entry, size)),
                Ok(None) => {}
                Err(StoreError::Corrupt(why)) => self.discard_file(&path, &why),
                // Gone since the listing, or unreadable: not indexed, left alone.
                Err(err) => tracing::warn!(%err, "kvcache-store: skipping a file at open"),
            }
        }
        found.sort_by_key(|(modified, ..)| *modified);
        let mut index = self.lock();
        for (_, key, entry, size) in found {
            index.insert(key, entry, size, &self.context);
        }
        Ok(())
    }

    /// The index entry of the file at `path` from its header; `None` for a file
    /// of another model or layout.
    fn read_index_entry(&self, path: &Path, key: &BlockKey) -> Result<Option<(Entry, u64, SystemTime)>> {
        let mut file = File::open(path).map_err(|e| StoreError::io("open", path, e))?;
        let meta = file.metadata().map_err(|e| StoreError::io("stat", path, e))?;
        let header = read_header(&mut file, path)?;
        if !header.belongs_to(&self.context) {
            return Ok(None);
        }
        self.check_header(&header, key, &header.namespace, meta.len())?;
        let modified = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
        let entry = Entry {
            namespace: header.namespace.clone(),
            parent: header.parent,
            tokens: header.tokens,
        };
        Ok(Some((entry, meta.len(), modified)))
    }

    /// Checks a header of this context against the key and namespace asked for
    /// and the file's length.
    fn check_header(&self, header: &Header, key: &BlockKey, namespace: &Namespace, len: u64) -> Result<()> {
        let corrupt = |why: &str| {
            Err(StoreError::Corrupt(format!(
                "{}: {why}",
                self.path_of(key).display()
            )))
        };
        if header.key != *key {
            return corrupt("header names another key");
        }
        if header.namespace != *namespace {
            return corrupt("header names another namespace");
        }
        header.check_tensors(&self.context.layout)?;
        if header.file_len() != len {
            return corrupt("file length differs from its header");
        }
        Ok(())
    }

    /// Removes a damaged file and counts it.
    fn discard_file(&self, path: &Path, why: &str) {
        tracing::warn!(path = %path.display(), why, "kvcache-store: removing a damaged entry");
        let _ = fs::remove_file(path);
        bump(&self.counters.corrupt);
    }

    /// Pops least recently used entries until the total fits the budget; returns
    /// the keys whose files must go.
    fn evict_to_budget(&self, index: &mut Index) -> Vec<BlockKey> {
        let mut victims = Vec::new();
        while index.lru.total() > self.budget {
            let Some((key, _)) = index.lru.pop_oldest() else {
                break;
            };
            index.forget(&key, &self.context);
            bump(&self.counters.evictions);
            victims.push(key);
        }
        victims
    }

    fn remove_files(&self, keys: &[BlockKey]) {
        for key in keys {
            let _ = fs::remove_file(self.path_of(key));
        }
    }

    /// Writes `blocks` as entries: each to a temporary file, all synced, all
    /// renamed, then one sync of the directory. A failure removes the temporary
    /// files not yet renamed; the blocks renamed before it are whole entries.
    fn write_atomically(&self, blocks: &[Pending<'_>]) -> Result<()> {
        // (open file, temporary path, final path) of each block written so far.
        let mut staged: Vec<(File, PathBuf, PathBuf)> = Vec::with_capacity(blocks.len());
        let mut renamed = 0;
        let result = (|| {
            for block in blocks {
                let serial = self.temp_serial.fetch_add(1, Ordering::Relaxed);
                let name = format!(
                    "{TEMP_PREFIX}{}-{}-{serial}",
                    block.key.to_hex(),
                    std::process::id()
                );
                let temp = self.dir.join(name);
                let mut file = File::create(&temp).map_err(|e| StoreError::io("create", &temp, e))?;
                let written = write_all_parts(&mut file, &block.header, &block.data);
                staged.push((file, temp.clone(), self.path_of(&block.key)));
                written.map_err(|e| StoreError::io("write", temp, e))?;
            }
            sync_all(&staged)?;
            for (_, temp, path) in &staged {
                fs::rename(temp, path).map_err(|e| StoreError::io("rename", temp, e))?;
                renamed += 1;
            }
            File::open(&self.dir)
                .and_then(|dir| dir.sync_all())
                .map_err(|e| StoreError::io("sync directory", &self.dir, e))
        })();
        for (_, temp, _) in &staged[renamed..] {
            let _ = fs::remove_file(temp);
        }
        result
    }

    /// Writes the `pending` blocks in groups of [`SYNC_GROUP`] (a few files
    /// open and syncing at a time, however long the run), each group indexed
    /// and the budget enforced as soon as it is written.
    ///
    /// The room a group needs is made before it is written (its sizes are
    /// known): the least recently used entries it displaces are forgotten
    /// first, and their files removed on a thread of their own while the group
    /// is written and synced, all before this returns. (A group that then
    /// fails to write has still displaced them.) Whatever is still over budget
    /// once the group is indexed (entries it replaced, a group larger than
    /// the budget) is evicted after it, as before.
    fn write_pending(&self, pending: &[Pending<'_>]) -> Result<()> {
        for group in pending.chunks(SYNC_GROUP) {
            let displaced = self.make_room(group);
            let written = std::thread::scope(|scope| {
                let remover = if displaced.is_empty() {
                    None
                } else {
                    let remove = || self.remove_files(&displaced);
                    match std::thread::Builder::new().spawn_scoped(scope, remove) {
                        Ok(thread) => Some(thread),
                        Err(_) => {
                            self.remove_files(&displaced);
                            None
                        }
                    }
                };
                let written = self.write_atomically(group);
                if let Some(thread) = remover {
                    // `remove_files` ignores failures; a panic there is not ours to raise.
                    let _ = thread.join();
                }
                written
            });
            written?;
            let victims = {
                let mut index = self.lock();
                for block in group {
                    index.insert(block.key, block.entry.clone(), block.size, &self.context);
                }
                self.evict_to_budget(&mut index)
            };
            self.remove_files(&victims);
        }
        Ok(())
    }

    /// Forgets least recently used entries (none of `group`'s keys) until the
    /// group's new entries fit the budget; returns the keys whose files must go.
    fn make_room(&self, group: &[Pending<'_>]) -> Vec<BlockKey> {
        let ours = |key: &BlockKey| group.iter().any(|block| block.key == *key);
        let mut index = self.lock();
        let incoming: u64 = group
            .iter()
            .filter(|block| !index.lru.contains(&block.key))
            .map(|block| block.size)
            .sum();
        let mut displaced = Vec::new();
        while index.lru.total().saturating_add(incoming) > self.budget {
            let Some(key) = index.lru.keys().find(|key| !ours(key)).copied() else {
                break;
            };
            index.forget(&key, &self.context);
            bump(&self.counters.evictions);
            displaced.push(key);
        }
        displaced
    }

    /// Opens the file of `key` and checks its header (`None`: no such file).
    fn open_checked(&self, namespace: &Namespace, key: &BlockKey, path: &Path) -> Result<Option<Opened>> {
        let mut file = match File::open(path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(StoreError::io("open", path, e)),
        };
        let meta = file.metadata().map_err(|e| StoreError::io("stat", path, e))?;
        let header = read_header(&mut file, path)?;
        if !header.belongs_to(&self.context) {
            return Err(StoreError::Corrupt(format!(
                "{}: written for another model or layout",
                path.display()
            )));
        }
        self.check_header(&header, key, namespace, meta.len())?;
        Ok(Some(Opened {
            file,
            header,
            modified: meta.modified().ok(),
        }))
    }

    /// Reads and checks the file of `key`; `Corrupt` when any check fails.
    fn read_block(&self, namespace: &Namespace, key: &BlockKey, path: &Path) -> Result<Option<Block>> {
        let Some(Opened {
            mut file,
            header,
            modified,
        }) = self.open_checked(namespace, key, path)?
        else {
            return Ok(None);
        };
        let mut data = Vec::with_capacity(header.data_len as usize);
        (&mut file)
            .take(header.data_len)
            .read_to_end(&mut data)
            .map_err(|e| StoreError::io("read", path, e))?;
        if data.len() as u64 != header.data_len {
            return Err(StoreError::Corrupt(format!("{}: truncated data", path.display())));
        }
        if crc32fast::hash(&data) != header.crc32 {
            return Err(StoreError::Corrupt(format!(
                "{}: checksum mismatch",
                path.display()
            )));
        }
        touch(&file, modified);
        let kv = HostKv::from_bytes(self.context.layout, header.start, header.tokens, data)
            .map_err(|e| StoreError::Corrupt(format!("{}: {e}", path.display())))?;
        Ok(Some(Block {
            key: *key,
            parent: header.parent,
            namespace: namespace.clone(),
            kv,
        }))
    }

    /// Forgets `key` and, for a damaged file, removes and counts it: what a read
    /// that failed its checks does.
    fn drop_entry(&self, key: &BlockKey, damaged: Option<&str>) {
        self.lock().forget(key, &self.context);
        if let Some(why) = damaged {
            self.discard_file(&self.path_of(key), why);
        }
    }
}

/// A block about to be written: its header and the slices of its data
/// section, in order.
struct Pending<'a> {
    key: BlockKey,
    entry: Entry,
    header: Vec<u8>,
    data: Vec<&'a [u8]>,
    /// The file's bytes.
    size: u64,
}

impl DiskTier {
    /// The block described, ready to write with its data in `data` (slices in
    /// order) of checksum `crc32`; `None` for a block larger than the whole
    /// budget, which is not kept.
    fn pending<'a>(
        &self,
        block: Describe<'_>,
        data: Vec<&'a [u8]>,
        crc32: u32,
    ) -> Result<Option<Pending<'a>>> {
        let header = encode_header(block, &self.context, crc32)?;
        let size = (header.len() + block.data_len()) as u64;
        if size > self.budget {
            return Ok(None);
        }
        Ok(Some(Pending {
            key: *block.key,
            entry: Entry {
                namespace: block.namespace.clone(),
                parent: *block.parent,
                tokens: block.tokens,
            },
            header,
            data,
            size,
        }))
    }
}

/// Writes `header` then every slice of `data` to `file`, in as few vectored
/// writes as the system takes.
fn write_all_parts(file: &mut File, header: &[u8], data: &[&[u8]]) -> std::io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = std::iter::once(header)
        .chain(data.iter().copied())
        .filter(|part| !part.is_empty())
        .map(IoSlice::new)
        .collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        match file.write_vectored(rest) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::WriteZero,
                    "failed to write a whole entry",
                ))
            }
            Ok(n) => IoSlice::advance_slices(&mut rest, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// An entry file, open and past its checked header.
struct Opened {
    file: File,
    header: Header,
    modified: Option<SystemTime>,
}

/// Refreshes the modification time of a file just read, which keeps the LRU
/// order across restarts, at a minute's resolution so that hot entries cost no
/// metadata write per read. Failing to is harmless.
fn touch(file: &File, modified: Option<SystemTime>) {
    let now = SystemTime::now();
    if modified.is_none_or(|m| now.duration_since(m).is_ok_and(|age| age > MTIME_RESOLUTION)) {
        let _ = file.set_modified(now);
    }
}

/// A [`RowReader`] over an entry file: reads straight into the fetch's answer,
/// checksumming as it goes.
struct DiskRows<'a> {
    tier: &'a DiskTier,
    key: BlockKey,
    opened: Opened,
    left: u64,
    hasher: crc32fast::Hasher,
    scratch: Vec<u8>,
}

impl DiskRows<'_> {
    fn truncated(&self) -> StoreError {
        let why = format!("{}: truncated data", self.tier.path_of(&self.key).display());
        self.tier.drop_entry(&self.key, Some(&why));
        StoreError::Corrupt(why)
    }
}

impl RowReader for DiskRows<'_> {
    fn read_to(&mut self, len: usize, out: &mut Vec<u8>) -> Result<()> {
        if len as u64 > self.left {
            return Err(StoreError::Corrupt("read past the end of a block".into()));
        }
        // Zeroing the run first costs little (it is in cache when the read
        // overwrites it) and lets one `read_exact` fill it: appending reads
        // (`read_to_end`, `io::copy`) start at 8 KiB and take four system calls
        // for a 64 KiB run.
        let before = out.len();
        out.resize(before + len, 0);
        if let Err(e) = self.opened.file.read_exact(&mut out[before..]) {
            out.truncate(before);
            return Err(if e.kind() == std::io::ErrorKind::UnexpectedEof {
                self.truncated()
            } else {
                StoreError::io("read", self.tier.path_of(&self.key), e)
            });
        }
        self.hasher.update(&out[before..]);
        self.left -= len as u64;
        Ok(())
    }

    fn skip(&mut self, len: usize) -> Result<()> {
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        let result = self.read_to(len, &mut scratch);
        self.scratch = scratch;
        result
    }

    fn finish(self: Box<Self>) -> Result<bool> {
        if self.left != 0 {
            return Ok(false);
        }
        if self.hasher.finalize() != self.opened.header.crc32 {
            let why = format!("{}: checksum mismatch", self.tier.path_of(&self.key).display());
            self.tier.drop_entry(&self.key, Some(&why));
            return Ok(false);
        }
        touch(&self.opened.file, self.opened.modified);
        Ok(true)
    }
}

impl Tier for DiskTier {
    fn name(&self) -> &'static str {
        "disk"
    }

    fn context(&self) -> &TierContext {
        &self.context
    }

    fn get(&self, namespace: &Namespace, key: &BlockKey, _deadline: Instant) -> Result<Option<Arc<Block>>> {
        {
            let mut index = self.lock();
            match index.entries.get(key) {
                Some(entry) if entry.namespace == *namespace => index.lru.touch(key),
                _ => return Ok(None),
            };
        }
        match self.read_block(namespace, key, &self.path_of(key)) {
            Ok(Some(block)) => Ok(Some(Arc::new(block))),
            Ok(None) => {
                self.drop_entry(key, None);
                Ok(None)
            }
            Err(StoreError::Corrupt(why)) => {
                self.drop_entry(key, Some(&why));
                Ok(None)
            }
            Err(err) => Err(err),
        }
    }

    fn holds(&self, namespace: &Namespace, key: &BlockKey) -> Option<bool> {
        let index = self.lock();
        Some(index.entries.get(key).is_some_and(|e| e.namespace == *namespace))
    }

    fn open_rows(&self, namespace: &Namespace, key: &BlockKey, _deadline: Instant) -> Result<OpenRows<'_>> {
        {
            let mut index = self.lock();
            match index.entries.get(key) {
                Some(entry) if entry.namespace == *namespace => index.lru.touch(key),
                _ => return Ok(None),
            };
        }
        let opened = match self.open_checked(namespace, key, &self.path_of(key)) {
            Ok(Some(opened)) => opened,
            Ok(None) => {
                self.drop_entry(key, None);
                return Ok(None);
            }
            Err(StoreError::Corrupt(why)) => {
                self.drop_entry(key, Some(&why));
                return Ok(None);
            }
            Err(err) => return Err(err),
        };
        let range = opened.header.start..opened.header.start + opened.header.tokens;
        let rows = DiskRows {
            tier: self,
            key: *key,
            left: opened.header.data_len,
            opened,
            hasher: crc32fast::Hasher::new(),
            scratch: Vec::new(),
        };
        Ok(Some((range, Box::new(rows))))
    }

    fn put(&self, block: &Arc<Block>, deadline: Instant) -> Result<()> {
        self.put_many(std::slice::from_ref(block), deadline)
    }

    fn put_many(&self, blocks: &[Arc<Block>], _deadline: Instant) -> Result<()> {
        let mut pending = Vec::with_capacity(blocks.len());
        for block in blocks {
            let data = block.kv.as_bytes();
            let describe = Describe::of(block);
            pending.extend(self.pending(describe, vec![data], crc32fast::hash(data))?);
        }
        self.write_pending(&pending)
    }

    fn writes_runs(&self) -> bool {
        true
    }

    /// Writes each block's file straight from the run's rows (a vectored write
    /// of the slices that hold them, checksummed in place): no copy of the
    /// block in memory. A range outside the run is
    /// [`StoreError::Corrupt`], and nothing is written.
    fn put_run(&self, run: &HostKv, blocks: &[RunBlock], _deadline: Instant) -> Result<()> {
        let mut pending = Vec::with_capacity(blocks.len());
        for block in blocks {
            let data = rows::slices(run, block.range.clone())
                .filter(|slices| !slices.is_empty() && !block.range.is_empty())
                .ok_or_else(|| {
                    StoreError::Corrupt(format!(
                        "a block of tokens {:?} outside the run {:?}",
                        block.range,
                        run.range()
                    ))
                })?;
            let mut hasher = crc32fast::Hasher::new();
            data.iter().for_each(|slice| hasher.update(slice));
            let describe = Describe {
                key: &block.key,
                parent: &block.parent,
                namespace: &block.namespace,
                layout: run.layout(),
                start: block.range.start,
                tokens: block.range.len(),
            };
            pending.extend(self.pending(describe, data, hasher.finalize())?);
        }
        self.write_pending(&pending)
    }

    fn contains(&self, namespace: &Namespace, key: &BlockKey, _deadline: Instant) -> Result<bool> {
        Ok(self
            .lock()
            .entries
            .get(key)
            .is_some_and(|entry| entry.namespace == *namespace))
    }

    fn remove(&self, namespace: &Namespace, key: &BlockKey, _deadline: Instant) -> Result<()> {
        let held = {
            let mut index = self.lock();
            let ours = index.entries.get(key).is_some_and(|e| e.namespace == *namespace);
            ours && index.forget(key, &self.context)
        };
        if held {
            let path = self.path_of(key);
            fs::remove_file(&path).map_err(|e| StoreError::io("remove", path, e))?;
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

    fn counters(&self) -> &TierCounters {
        &self.counters
    }
}

/// Syncs the staged files side by side (the file system folds concurrent syncs
/// into fewer journal commits and device flushes); inline where a thread cannot
/// be had.
fn sync_all(staged: &[(File, PathBuf, PathBuf)]) -> Result<()> {
    let sync = |(file, temp, _): &(File, PathBuf, PathBuf)| {
        file.sync_all().map_err(|e| StoreError::io("sync", temp, e))
    };
    if staged.len() < 2 {
        return staged.iter().try_for_each(sync);
    }
    std::thread::scope(|scope| {
        let mut inline = Vec::new();
        let mut threads = Vec::new();
        for entry in staged {
            match std::thread::Builder::new().spawn_scoped(scope, move || sync(entry)) {
                Ok(thread) => threads.push(thread),
                Err(_) => inline.push(entry),
            }
        }
        inline.into_iter().try_for_each(sync)?;
        threads.into_iter().try_for_each(|thread| {
            thread.join().unwrap_or_else(|_| {
                let panicked = std::io::Error::other("a sync thread panicked");
                Err(StoreError::io("sync", PathBuf::new(), panicked))
            })
        })
    })
}

#[cfg(test)]
mod tests {
    use kvcache_api::{DType, Fingerprint, KvLayout};

    use super::*;

    /// Blocks written straight from a run make the same files (header and
    /// data) as the same blocks cut into memory first, and read back whole.
    #[test]
    fn a_run_written_in_place_makes_the_same_files_as_its_blocks() {
        let layout = KvLayout::new(3, 2, 4, DType::F16);
        let context = TierContext {
            fingerprint: Fingerprint([3; 32]),
            layout,
            block_tokens: 4,
        };
        let tokens = 10;
        let bytes: Vec<u8> = (0..tokens * layout.token_bytes())
            .map(|i| (i * 13) as u8)
            .collect();
        let run = HostKv::from_bytes(layout, 8, tokens, bytes).unwrap();
        let ns = Namespace::new("t").unwrap();
        let key = |i: u8| BlockKey::from_hex(&format!("{i:02x}").repeat(32)).unwrap();
        let blocks: Vec<RunBlock> = [8..12, 12..16, 16..18]
            .into_iter()
            .enumerate()
            .map(|(i, range)| RunBlock {
                key: key(i as u8 + 1),
                parent: key(i as u8),
                namespace: ns.clone(),
                range,
            })
            .collect();
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let in_place = DiskTier::open(context, a.path(), 1 << 20).unwrap();
        let cut = DiskTier::open(context, b.path(), 1 << 20).unwrap();
        let later = Instant::now() + std::time::Duration::from_secs(60);
        in_place.put_run(&run, &blocks, later).unwrap();
        let whole: Vec<Arc<Block>> = blocks
            .iter()
            .map(|b| Arc::new(b.to_block(&run).unwrap()))
            .collect();
        cut.put_many(&whole, later).unwrap();
        for block in &whole {
            // The same header (as JSON: the metadata map's order varies) and
            // the same data section.
            let parts = |path: PathBuf| {
                let file = fs::read(path).unwrap();
                let n = 8 + u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
                let json: serde_json::Value = serde_json::from_slice(&file[8..n]).unwrap();
                (json, file[n..].to_vec())
            };
            let ours = parts(in_place.path_of(&block.key));
            assert_eq!(ours, parts(cut.path_of(&block.key)));
            assert_eq!(ours.1, block.kv.as_bytes());
            let back = in_place.get(&ns, &block.key, later).unwrap().unwrap();
            assert_eq!(back.kv, block.kv);
            assert_eq!(back.parent, block.parent);
        }
        assert_eq!(in_place.used_bytes().unwrap(), cut.used_bytes().unwrap());
        // A range outside the run writes nothing.
        let outside = RunBlock {
            range: 16..20,
            ..blocks[2].clone()
        };
        assert!(in_place.put_run(&run, &[outside], later).is_err());
    }
}
