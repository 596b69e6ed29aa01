//! [`TieredStore`]: the [`PrefixStore`] over an ordered list of tiers.
//!
//! Writes go through the background [`Writer`](crate::writer): a submitted run is
//! cut into blocks (the last one may be a tail), keyed, and written to every
//! tier. Blocks stay ranges of the run for tiers that write straight from it
//! (the disk tier); they are copied into blocks of their own once, for the
//! first tier that keeps them (memory, Redis), and shared from then on. Fetches run on the caller's thread within its deadline: planned and
//! read straight into the answer where every tier knows what it holds, else
//! block by block and tier by tier (fastest first); a block found in a slower
//! tier is promoted into the in-memory tiers above it.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvcache_api::{Fetched, Fingerprint, HostKv, HostState, KvLayout, Namespace, PrefixStore};

use crate::error::{Result, StoreError};
use crate::keys::{BlockKey, KeyChain};
use crate::known::KnownKeys;
use crate::namespace::Scope;
use crate::rows;
use crate::states;
use crate::stats::{add, bump, StoreCounters, StoreStats};
use crate::tier::{Block, RunBlock, Tier, TierContext};
use crate::writer::{Refused, Writer};

/// What a planned fetch (`TieredStore::fetch_planned`) came to.
enum Planned {
    /// The answer: what the tiers hold past `from`, or nothing (none held,
    /// or out of time).
    Answered(Option<Fetched>),
    /// The plan did not hold up (an entry vanished or failed its checks, or
    /// the plan was too long): read block by block instead.
    Unplanned,
}

/// The most blocks a planned fetch reads at once (one open reader each);
/// longer answers are read block by block.
const MAX_PLANNED_BLOCKS: usize = 256;

/// The model, layout, block size and writer settings of a [`TieredStore`].
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// The model whose keys and values are stored.
    pub fingerprint: Fingerprint,
    /// Their layout.
    pub layout: KvLayout,
    /// Tokens per block (default 256).
    pub block_tokens: usize,
    /// Submitted runs (and state entries) the writer queue holds before it
    /// drops more (default 64): the bound of the memory that writes not yet
    /// made may take. A dropped submit returns [`Submitted::Dropped`], is
    /// counted ([`StoreStats::dropped`]) and logged (a `warn` at most once a
    /// second, with the count since the last one).
    pub queue_capacity: usize,
    /// The longest the writes of one run to one tier may take (default 30 s).
    pub write_timeout: Duration,
    /// Block keys remembered for [`PrefixStore::known_prefix`] (default 1 Mi).
    pub known_keys: usize,
}

impl StoreConfig {
    /// The defaults for `layout` of the model `fingerprint`.
    pub fn new(fingerprint: Fingerprint, layout: KvLayout) -> Self {
        StoreConfig {
            fingerprint,
            layout,
            block_tokens: 256,
            queue_capacity: 64,
            write_timeout: Duration::from_secs(30),
            known_keys: 1 << 20,
        }
    }

    /// With blocks of `tokens` tokens.
    pub fn with_block_tokens(mut self, tokens: usize) -> Self {
        self.block_tokens = tokens;
        self
    }

    /// With a writer queue of `runs` submitted runs.
    pub fn with_queue_capacity(mut self, runs: usize) -> Self {
        self.queue_capacity = runs;
        self
    }

    /// What this store's tiers must be built for.
    pub fn context(&self) -> TierContext {
        TierContext {
            fingerprint: self.fingerprint,
            layout: self.layout,
            block_tokens: self.block_tokens,
        }
    }
}

/// A tiered, content-addressed [`PrefixStore`]: see the [crate docs](crate).
pub struct TieredStore {
    core: Arc<Core>,
    writer: Writer<Job>,
}

impl std::fmt::Debug for TieredStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TieredStore")
            .field("config", &self.core.config)
            .field(
                "tiers",
                &self.core.tiers.iter().map(|t| t.name()).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// What the caller's threads and the writer share.
struct Core {
    config: StoreConfig,
    tiers: Vec<Box<dyn Tier>>,
    /// Whether every tier says what it holds without I/O (then fetches plan
    /// first and assemble straight from row readers).
    local: bool,
    known: KnownKeys,
    counters: StoreCounters,
    drops: std::sync::Mutex<DropLog>,
}

/// What a submit did with its run (or states), as every [`PrefixStore`]
/// answers: for this store, `Queued` means in the writer's queue (written to
/// every tier soon; [`TieredStore::flush`] waits for it), `Dropped` a full
/// queue (its bound is [`StoreConfig::queue_capacity`]; counted in
/// [`StoreStats::dropped`] and logged), `Rejected` invalid input (counted in
/// [`StoreStats::rejected`]).
pub use kvcache_api::Submitted;

/// Drops since the last warning, and when it was: one `warn` a second at most.
#[derive(Debug, Default)]
struct DropLog {
    last_warning: Option<Instant>,
    unreported: u64,
}

/// The least time between two warnings about dropped writes.
const DROP_WARNING_EVERY: Duration = Duration::from_secs(1);

/// What the writer receives: a submitted run, or submitted states.
enum Job {
    Run(Run),
    States(States),
}

/// One submitted run.
struct Run {
    namespace: Namespace,
    tokens: Vec<u32>,
    kv: HostKv,
}

/// Whole layer states standing at the end of `tokens`, sorted by layer.
struct States {
    namespace: Namespace,
    tokens: Vec<u32>,
    states: Vec<(usize, HostState)>,
}

/// Blocks on their way to the tiers.
enum Pending {
    /// The blocks of a submitted run, as ranges of it. Tiers that write
    /// straight from a run ([`Tier::writes_runs`]: the disk tier) get it as
    /// it came; the blocks are cut into memory once, for the first tier that
    /// wants them whole (the memory tier keeps them), and shared from then on.
    Run {
        /// The run, until it is cut (a run of one block moves into it).
        kv: Option<HostKv>,
        blocks: Vec<RunBlock>,
        cut: Option<Vec<Arc<Block>>>,
    },
    /// Whole blocks (the parts of submitted states).
    Whole(Vec<Arc<Block>>),
}

impl Pending {
    /// The namespace and key of each block, in order.
    fn keys(&self) -> Vec<(Namespace, BlockKey)> {
        match self {
            Pending::Run { blocks, .. } => blocks.iter().map(|b| (b.namespace.clone(), b.key)).collect(),
            Pending::Whole(blocks) => blocks.iter().map(|b| (b.namespace.clone(), b.key)).collect(),
        }
    }

    /// Stores blocks `wanted` (indices) in `tier`; the bytes of keys and
    /// values stored.
    fn put(
        &mut self,
        tier: &dyn Tier,
        layout: &KvLayout,
        wanted: &[usize],
        deadline: Instant,
    ) -> Result<u64> {
        if let Pending::Run {
            kv: Some(kv),
            blocks,
            cut: None,
        } = self
        {
            if tier.writes_runs() {
                let chosen: Vec<RunBlock> = wanted.iter().filter_map(|&i| blocks.get(i).cloned()).collect();
                tier.put_run(kv, &chosen, deadline)?;
                let tokens: usize = chosen.iter().map(|b| b.range.len()).sum();
                return Ok((tokens * layout.token_bytes()) as u64);
            }
        }
        let whole = self.whole()?;
        let chosen: Vec<Arc<Block>> = wanted.iter().filter_map(|&i| whole.get(i).cloned()).collect();
        tier.put_many(&chosen, deadline)?;
        Ok(chosen.iter().map(|b| b.bytes()).sum())
    }

    /// The blocks in memory, cut from the run the first time.
    fn whole(&mut self) -> Result<&[Arc<Block>]> {
        match self {
            Pending::Whole(blocks) => Ok(blocks),
            Pending::Run { kv, blocks, cut } => {
                if cut.is_none() {
                    let lost = || StoreError::Corrupt("a run without its rows".into());
                    let parts = match (blocks.as_slice(), kv.as_ref()) {
                        // A run of one block is stored as it came, without a copy.
                        ([only], Some(run)) if only.range == run.range() => vec![Arc::new(Block {
                            key: only.key,
                            parent: only.parent,
                            namespace: only.namespace.clone(),
                            kv: kv.take().ok_or_else(lost)?,
                        })],
                        (_, run) => {
                            let run = run.ok_or_else(lost)?;
                            blocks
                                .iter()
                                .map(|block| block.to_block(run).map(Arc::new))
                                .collect::<Result<Vec<_>>>()?
                        }
                    };
                    // Every tier from now on is served from the cut blocks.
                    *kv = None;
                    *cut = Some(parts);
                }
                Ok(cut.as_deref().unwrap_or(&[]))
            }
        }
    }
}

/// Where one block was found.
enum Lookup {
    Found(Arc<Block>, usize),
    Missing,
    OutOfTime,
}

impl TieredStore {
    /// A store over `tiers`, fastest first, all built for `config.context()`;
    /// starts the writer thread.
    pub fn new(config: StoreConfig, tiers: Vec<Box<dyn Tier>>) -> Result<Self> {
        if config.block_tokens == 0 || config.queue_capacity == 0 {
            return Err(StoreError::Config(
                "block_tokens and queue_capacity must be at least 1".into(),
            ));
        }
        let context = config.context();
        for tier in &tiers {
            let theirs = tier.context();
            let what = if theirs.fingerprint != context.fingerprint {
                "fingerprint"
            } else if theirs.layout != context.layout {
                "layout"
            } else if theirs.block_tokens != context.block_tokens {
                "block size"
            } else {
                continue;
            };
            return Err(StoreError::TierMismatch {
                tier: tier.name(),
                what,
            });
        }
        let probe = (Namespace::shared(), BlockKey::ROOT);
        let local = tiers.iter().all(|t| t.holds(&probe.0, &probe.1).is_some());
        let core = Arc::new(Core {
            local,
            known: KnownKeys::new(config.known_keys),
            config,
            tiers,
            counters: StoreCounters::default(),
            drops: Default::default(),
        });
        let theirs = Arc::clone(&core);
        let writer = Writer::spawn("kvcache-store-writer", core.config.queue_capacity, move |job| {
            theirs.write(job)
        })?;
        Ok(TieredStore { core, writer })
    }

    /// The configuration.
    pub fn config(&self) -> &StoreConfig {
        &self.core.config
    }

    /// The tiers, fastest first.
    pub fn tiers(&self) -> &[Box<dyn Tier>] {
        &self.core.tiers
    }

    /// Waits until every run submitted before this call is written.
    pub fn flush(&self) {
        self.writer.flush();
    }

    /// [`PrefixStore::submit`], saying what became of the run: queued,
    /// dropped because the writer queue was full, or rejected as invalid.
    /// Never blocks.
    pub fn try_submit(&self, namespace: &Namespace, tokens: &[u32], kv: HostKv) -> Submitted {
        let core = &self.core;
        if let Some(why) = core.check_submit(tokens, &kv) {
            bump(&core.counters.rejected);
            tracing::warn!(why, "kvcache-store: submit rejected");
            return Submitted::Rejected;
        }
        let job = Job::Run(Run {
            namespace: namespace.clone(),
            tokens: tokens[..kv.end()].to_vec(),
            kv,
        });
        self.queue(job, &core.counters.submitted)
    }

    /// [`PrefixStore::submit_states`], saying what became of the states (as
    /// [`TieredStore::try_submit`]). Rejected (and counted `rejected`): no
    /// states, a state not at `tokens.len()`, a layer out of range or given
    /// twice, an array whose bytes do not fit its shape, empty `tokens`.
    pub fn try_submit_states(
        &self,
        namespace: &Namespace,
        tokens: &[u32],
        mut states: Vec<(usize, HostState)>,
    ) -> Submitted {
        let core = &self.core;
        states.sort_by_key(|(layer, _)| *layer);
        let layers = core.config.layout.layers;
        let fits = !tokens.is_empty()
            && !states.is_empty()
            && states.windows(2).all(|w| w[0].0 < w[1].0)
            && states
                .iter()
                .all(|(layer, s)| *layer < layers && s.offset == tokens.len() && s.check().is_ok());
        if !fits {
            bump(&core.counters.rejected);
            tracing::warn!("kvcache-store: states submit rejected");
            return Submitted::Rejected;
        }
        let job = Job::States(States {
            namespace: namespace.clone(),
            tokens: tokens.to_vec(),
            states,
        });
        self.queue(job, &core.counters.states_submitted)
    }

    /// Hands `job` to the writer; counts it in `accepted`, or as dropped
    /// (with a rate-limited warning).
    fn queue(&self, job: Job, accepted: &std::sync::atomic::AtomicU64) -> Submitted {
        let core = &self.core;
        let queue_len = match self.writer.try_submit(job) {
            Ok(()) => {
                bump(accepted);
                return Submitted::Queued;
            }
            Err(Refused::Full) => core.config.queue_capacity,
            Err(Refused::Closed) => 0,
        };
        bump(&core.counters.dropped);
        let mut drops = core.drops.lock().unwrap_or_else(|p| p.into_inner());
        drops.unreported += 1;
        let now = Instant::now();
        if drops
            .last_warning
            .is_none_or(|last| now.duration_since(last) >= DROP_WARNING_EVERY)
        {
            tracing::warn!(
                dropped = drops.unreported,
                queue_len,
                "kvcache-store: writer queue full, write dropped (not stored; raise StoreConfig::queue_capacity \
                 if this repeats)"
            );
            drops.last_warning = Some(now);
            drops.unreported = 0;
        }
        Submitted::Dropped { queue_len }
    }

    /// The counters of the store and of every tier (asks Redis for its
    /// `used_memory`).
    pub fn stats(&self) -> StoreStats {
        let tiers = self.core.tiers.iter().map(|t| t.stats()).collect();
        self.core.counters.snapshot(tiers)
    }
}

impl Drop for TieredStore {
    /// Writes what is queued, then stops the writer.
    fn drop(&mut self) {
        self.writer.shutdown();
    }
}

impl Core {
    /// Cuts a submitted run into blocks (or encodes submitted states into
    /// parts) and writes them to every tier.
    fn write(&self, job: Job) {
        match job {
            Job::Run(run) => {
                let blocks = self.cut(&run);
                let stored = self.write_blocks(Pending::Run {
                    kv: Some(run.kv),
                    blocks,
                    cut: None,
                });
                add(&self.counters.blocks_written, stored);
                bump(&self.counters.runs_written);
            }
            Job::States(job) => {
                let parts = self.state_parts(&job);
                let count = parts.len() as u64;
                if count > 0 && self.write_blocks(Pending::Whole(parts)) == count {
                    bump(&self.counters.states_written);
                }
            }
        }
    }

    /// The parts of submitted states (see [`states`]): blocks whose rows carry
    /// the encoded entry, zero-padded to whole tokens.
    fn state_parts(&self, job: &States) -> Vec<Arc<Block>> {
        let layout = self.config.layout;
        let token = layout.token_bytes().max(1);
        let scope = Scope::new(&self.config.fingerprint, &job.namespace);
        let block_tokens = self.config.block_tokens;
        let prefix = states::prefix_key(scope, block_tokens, &job.tokens);
        let bytes = states::encode(&job.states);
        let size = states::part_bytes(&layout, block_tokens);
        let mut parts = Vec::with_capacity(states::parts_for(bytes.len(), size));
        for (i, chunk) in bytes.chunks(size).enumerate() {
            let tokens = chunk.len().div_ceil(token);
            let mut data = Vec::with_capacity(tokens * token);
            data.extend_from_slice(chunk);
            data.resize(tokens * token, 0);
            let Ok(kv) = HostKv::from_bytes(layout, 0, tokens, data) else {
                return Vec::new();
            };
            parts.push(Arc::new(Block {
                key: states::part_key_of(&scope, &prefix, job.tokens.len(), i as u32),
                parent: states::STATE_PARENT,
                namespace: job.namespace.clone(),
                kv,
            }));
        }
        parts
    }

    /// The states stored for exactly `tokens`: every part read (tier by tier,
    /// promoted like blocks) within the deadline, joined and decoded.
    fn fetch_states(
        &self,
        namespace: &Namespace,
        tokens: &[u32],
        budget: Duration,
    ) -> Option<Vec<(usize, HostState)>> {
        bump(&self.counters.state_fetches);
        if tokens.is_empty() {
            return None;
        }
        let now = Instant::now();
        let deadline = now
            .checked_add(budget)
            .unwrap_or(now + Duration::from_secs(86_400 * 365));
        let layout = self.config.layout;
        let token = layout.token_bytes().max(1);
        let scope = Scope::new(&self.config.fingerprint, namespace);
        let prefix = states::prefix_key(scope, self.config.block_tokens, tokens);
        let size = states::part_bytes(&layout, self.config.block_tokens);
        let mut bytes = Vec::new();
        // The first part says how long the entry is, hence how many parts
        // there are and how many tokens each holds.
        let mut len = size;
        let mut i = 0;
        while i < states::parts_for(len, size) {
            let carried = (len - i * size).min(size);
            let expected = (i > 0).then_some(0..carried.div_ceil(token));
            let key = states::part_key_of(&scope, &prefix, tokens.len(), i as u32);
            let block = match self.lookup(namespace, &key, expected, deadline) {
                Lookup::Found(block, _) => block,
                Lookup::Missing => return None,
                Lookup::OutOfTime => {
                    bump(&self.counters.fetch_timeouts);
                    return None;
                }
            };
            bytes.extend_from_slice(block.kv.as_bytes());
            if i == 0 {
                let first = states::encoded_len(&bytes);
                let fits = first.is_some_and(|first| {
                    block.kv.start() == 0 && block.kv.tokens() == first.min(size).div_ceil(token)
                });
                let (true, Some(first)) = (fits, first) else {
                    bump(&self.counters.state_corrupt);
                    return None;
                };
                len = first;
                bytes.reserve(len.saturating_sub(bytes.len()));
            }
            i += 1;
        }
        let decoded = bytes
            .get(..len)
            .and_then(states::decode)
            .filter(|found| found.iter().all(|(_, s)| s.offset == tokens.len()));
        match decoded {
            Some(found) => {
                bump(&self.counters.state_hits);
                Some(found)
            }
            None => {
                bump(&self.counters.state_corrupt);
                None
            }
        }
    }

    /// The blocks of a submitted run, keyed, as token ranges of it (nothing
    /// copied); the last may be a tail.
    fn cut(&self, job: &Run) -> Vec<RunBlock> {
        let scope = Scope::new(&self.config.fingerprint, &job.namespace);
        let block_tokens = self.config.block_tokens;
        let mut chain = KeyChain::new(scope, block_tokens, &job.tokens);
        chain.skip_to(job.kv.start());
        let whole = job.kv.range();
        let mut blocks = Vec::with_capacity(whole.len().div_ceil(block_tokens));
        let mut pos = whole.start;
        while pos < whole.end {
            let len = block_tokens.min(whole.end - pos);
            let parent = chain.parent();
            let key = if len == block_tokens {
                chain.next().map(|(_, key)| key)
            } else {
                chain.tail_key(len)
            };
            let Some(key) = key else { break };
            blocks.push(RunBlock {
                key,
                parent,
                namespace: job.namespace.clone(),
                range: pos..pos + len,
            });
            pos += len;
        }
        blocks
    }

    /// Writes to every tier the blocks it lacks, in one batch per tier;
    /// returns how many blocks at least one tier holds now.
    fn write_blocks(&self, mut pending: Pending) -> u64 {
        let keys: Vec<(Namespace, BlockKey)> = pending.keys();
        let mut stored = vec![false; keys.len()];
        for tier in &self.tiers {
            let deadline = Instant::now() + self.config.write_timeout;
            let counters = tier.counters();
            let mut wanted = Vec::with_capacity(keys.len());
            for (i, (namespace, key)) in keys.iter().enumerate() {
                match tier.contains(namespace, key, deadline) {
                    Ok(true) => stored[i] = true,
                    Ok(false) => wanted.push(i),
                    Err(err) => {
                        bump(&counters.errors);
                        tracing::debug!(tier = tier.name(), %err, "kvcache-store: write skipped");
                    }
                }
            }
            if wanted.is_empty() {
                continue;
            }
            match pending.put(tier.as_ref(), &self.config.layout, &wanted, deadline) {
                Ok(bytes) => {
                    add(&counters.puts, wanted.len() as u64);
                    add(&counters.bytes_written, bytes);
                    wanted.into_iter().for_each(|i| stored[i] = true);
                }
                Err(err) => {
                    bump(&counters.errors);
                    tracing::debug!(tier = tier.name(), %err, "kvcache-store: write failed");
                }
            }
        }
        let mut count = 0;
        for ((_, key), stored) in keys.iter().zip(stored) {
            if stored {
                self.known.insert(*key);
                count += 1;
            }
        }
        count
    }

    /// Looks for block `key` (covering `range`, if given) tier by tier;
    /// promotes a block found below an in-memory tier into it.
    fn lookup(
        &self,
        namespace: &Namespace,
        key: &BlockKey,
        range: Option<Range<usize>>,
        deadline: Instant,
    ) -> Lookup {
        let mut failed = false;
        for (i, tier) in self.tiers.iter().enumerate() {
            if Instant::now() >= deadline {
                return Lookup::OutOfTime;
            }
            let counters = tier.counters();
            match tier.get(namespace, key, deadline) {
                Ok(Some(block))
                    if range.as_ref().is_none_or(|r| block.kv.range() == *r)
                        && block.kv.layout() == &self.config.layout =>
                {
                    bump(&counters.hits);
                    add(&counters.bytes_read, block.bytes());
                    for upper in self.tiers[..i].iter().filter(|t| t.promotes()) {
                        if upper.put(&block, deadline).is_err() {
                            bump(&upper.counters().errors);
                        }
                    }
                    self.known.insert(*key);
                    return Lookup::Found(block, i);
                }
                Ok(_) => bump(&counters.misses),
                Err(StoreError::Timeout) => {
                    bump(&counters.errors);
                    return Lookup::OutOfTime;
                }
                Err(err) => {
                    bump(&counters.errors);
                    failed = true;
                    tracing::debug!(tier = tier.name(), %err, "kvcache-store: read failed");
                }
            }
        }
        if !failed {
            self.known.forget(key);
        }
        Lookup::Missing
    }

    /// Tail lengths stored after `parent`, longest first, from every tier.
    fn tails(&self, namespace: &Namespace, parent: &BlockKey, deadline: Instant) -> (Vec<usize>, bool) {
        let mut lengths = Vec::new();
        for tier in &self.tiers {
            if Instant::now() >= deadline {
                return (lengths, true);
            }
            match tier.tails(namespace, parent, deadline) {
                Ok(found) => lengths.extend(found),
                Err(err) => {
                    bump(&tier.counters().errors);
                    if matches!(err, StoreError::Timeout) {
                        return (lengths, true);
                    }
                }
            }
        }
        lengths.sort_unstable_by(|a, b| b.cmp(a));
        lengths.dedup();
        (lengths, false)
    }

    fn fetch(&self, namespace: &Namespace, tokens: &[u32], from: usize, budget: Duration) -> Option<Fetched> {
        bump(&self.counters.fetches);
        if from >= tokens.len() {
            return None;
        }
        let now = Instant::now();
        let deadline = now
            .checked_add(budget)
            .unwrap_or(now + Duration::from_secs(86_400 * 365));
        if self.local {
            if let Planned::Answered(answer) = self.fetch_planned(namespace, tokens, from, deadline) {
                return answer;
            }
        }
        let scope = Scope::new(&self.config.fingerprint, namespace);
        let mut chain = KeyChain::new(scope, self.config.block_tokens, tokens);
        chain.skip_to(from);
        let mut parts: Vec<(Arc<Block>, usize)> = Vec::new();
        let mut out_of_time = false;
        while let Some((range, key)) = chain.peek() {
            match self.lookup(namespace, &key, Some(range), deadline) {
                Lookup::Found(block, tier) => {
                    parts.push((block, tier));
                    chain.next();
                }
                Lookup::Missing => break,
                Lookup::OutOfTime => {
                    out_of_time = true;
                    break;
                }
            }
        }
        if !out_of_time && chain.remaining() > 0 {
            let (lengths, late) = self.tails(namespace, &chain.parent(), deadline);
            out_of_time = late;
            for len in lengths.into_iter().filter(|&len| len <= chain.remaining()) {
                let Some(key) = chain.tail_key(len) else { continue };
                let range = chain.position()..chain.position() + len;
                match self.lookup(namespace, &key, Some(range), deadline) {
                    Lookup::Found(block, tier) => {
                        parts.push((block, tier));
                        break;
                    }
                    Lookup::Missing => {}
                    Lookup::OutOfTime => {
                        out_of_time = true;
                        break;
                    }
                }
            }
        }
        if out_of_time {
            bump(&self.counters.fetch_timeouts);
        }
        self.assemble(&parts, from)
    }

    /// The first tier that holds `key`, as the tiers tell without I/O.
    fn holder(&self, namespace: &Namespace, key: &BlockKey) -> Option<usize> {
        self.tiers
            .iter()
            .position(|tier| tier.holds(namespace, key) == Some(true))
    }

    /// A fetch over tiers that all know what they hold: plans the blocks (no
    /// I/O), then appends each head's rows, block after block, straight from
    /// the tiers' row readers into the answer (one copy, checksums verified on
    /// the way). `None` when the plan does not hold up (an entry vanished or
    /// failed its checks): the caller falls back to reading block by block,
    /// which counts and removes what is damaged ([`Planned::Unplanned`]).
    fn fetch_planned(
        &self,
        namespace: &Namespace,
        tokens: &[u32],
        from: usize,
        deadline: Instant,
    ) -> Planned {
        let scope = Scope::new(&self.config.fingerprint, namespace);
        let mut chain = KeyChain::new(scope, self.config.block_tokens, tokens);
        chain.skip_to(from);
        // (token range, key, parent, tier) of each block, in order.
        let mut plan: Vec<(Range<usize>, BlockKey, BlockKey, usize)> = Vec::new();
        while let Some((range, key)) = chain.peek() {
            let Some(tier) = self.holder(namespace, &key) else {
                break;
            };
            plan.push((range, key, chain.parent(), tier));
            chain.next();
        }
        if chain.remaining() > 0 {
            let (lengths, _) = self.tails(namespace, &chain.parent(), deadline);
            for len in lengths.into_iter().filter(|&len| len <= chain.remaining()) {
                let Some(key) = chain.tail_key(len) else { continue };
                if let Some(tier) = self.holder(namespace, &key) {
                    let at = chain.position();
                    plan.push((at..at + len, key, chain.parent(), tier));
                    break;
                }
            }
        }
        let Some(end) = plan.last().map(|(range, ..)| range.end).filter(|&end| end > from) else {
            self.tiers.iter().for_each(|t| bump(&t.counters().misses));
            return Planned::Answered(None);
        };
        if plan.len() > MAX_PLANNED_BLOCKS {
            return Planned::Unplanned;
        }
        let mut readers = Vec::with_capacity(plan.len());
        for (range, key, _, tier) in &plan {
            match self.tiers[*tier].open_rows(namespace, key, deadline) {
                Ok(Some((held, reader))) if held == *range => readers.push(reader),
                _ => return Planned::Unplanned,
            }
        }
        let layout = &self.config.layout;
        let elem = layout.dtype.size_in_bytes();
        let mut out = Vec::with_capacity((end - from) * layout.token_bytes());
        for _layer in 0..layout.layers {
            if Instant::now() >= deadline {
                bump(&self.counters.fetch_timeouts);
                return Planned::Answered(None);
            }
            for dim in [layout.head_dim, layout.head_dim_v] {
                let row = dim * elem;
                for _head in 0..layout.kv_heads {
                    for ((range, ..), reader) in plan.iter().zip(readers.iter_mut()) {
                        let skip = from.saturating_sub(range.start);
                        let read = reader
                            .skip(skip * row)
                            .and_then(|()| reader.read_to((range.len() - skip) * row, &mut out));
                        if read.is_err() {
                            return Planned::Unplanned;
                        }
                    }
                }
            }
        }
        for reader in readers {
            if !matches!(reader.finish(), Ok(true)) {
                return Planned::Unplanned;
            }
        }
        let Ok(kv) = HostKv::from_bytes(*layout, from, end - from, out) else {
            return Planned::Unplanned;
        };
        let mut served = vec![0usize; self.tiers.len()];
        for (range, key, parent, tier) in &plan {
            let counters = self.tiers[*tier].counters();
            bump(&counters.hits);
            add(&counters.bytes_read, (range.len() * layout.token_bytes()) as u64);
            served[*tier] += range.end - range.start.max(from);
            self.known.insert(*key);
            self.promote(namespace, &kv, range, key, parent, *tier, deadline);
        }
        Planned::Answered(Some(self.fetched(kv, served)))
    }

    /// Copies a block of the answer `kv`, served by tier `from_tier`, into the
    /// in-memory tiers above it (not a block that starts before the answer).
    #[allow(clippy::too_many_arguments)]
    fn promote(
        &self,
        namespace: &Namespace,
        kv: &HostKv,
        range: &Range<usize>,
        key: &BlockKey,
        parent: &BlockKey,
        from_tier: usize,
        deadline: Instant,
    ) {
        let mut uppers = self.tiers[..from_tier].iter().filter(|t| t.promotes()).peekable();
        if uppers.peek().is_none() || range.start < kv.start() {
            return;
        }
        let Ok(rows) = rows::join(&self.config.layout, &[kv], range.clone()) else {
            return;
        };
        let block = Arc::new(Block {
            key: *key,
            parent: *parent,
            namespace: namespace.clone(),
            kv: rows,
        });
        for upper in uppers {
            if upper.put(&block, deadline).is_err() {
                bump(&upper.counters().errors);
            }
        }
    }

    /// The answer, with the tokens each tier served.
    fn fetched(&self, kv: HostKv, served: Vec<usize>) -> Fetched {
        let tiers = served
            .into_iter()
            .enumerate()
            .filter(|&(_, tokens)| tokens > 0)
            .map(|(i, tokens)| (self.tiers[i].name(), tokens))
            .collect();
        Fetched { kv, tiers }
    }

    /// Joins the blocks found into `[from, end)` and says which tier served what.
    fn assemble(&self, parts: &[(Arc<Block>, usize)], from: usize) -> Option<Fetched> {
        let end = parts.last()?.0.kv.end();
        if end <= from {
            return None;
        }
        let kvs: Vec<&HostKv> = parts.iter().map(|(block, _)| &block.kv).collect();
        let kv = match rows::join(&self.config.layout, &kvs, from..end) {
            Ok(kv) => kv,
            Err(err) => {
                tracing::warn!(%err, "kvcache-store: cannot join blocks");
                return None;
            }
        };
        let mut served = vec![0usize; self.tiers.len()];
        for (block, tier) in parts {
            served[*tier] += block.kv.end() - block.kv.start().max(from);
        }
        Some(self.fetched(kv, served))
    }

    fn known_prefix(&self, namespace: &Namespace, tokens: &[u32]) -> usize {
        self.known_from(namespace, tokens, 0)
    }

    /// How far from `from` (rounded down to a block) the keys this process
    /// wrote or read hold `tokens` without a gap.
    fn known_from(&self, namespace: &Namespace, tokens: &[u32], from: usize) -> usize {
        let scope = Scope::new(&self.config.fingerprint, namespace);
        let mut chain = KeyChain::new(scope, self.config.block_tokens, tokens);
        chain.skip_to(from);
        while let Some((_, key)) = chain.peek() {
            if !self.known.contains(&key) {
                return chain.position();
            }
            chain.next();
        }
        let rest = chain.remaining();
        match chain.tail_key(rest) {
            Some(key) if rest > 0 && self.known.contains(&key) => tokens.len(),
            _ => chain.position(),
        }
    }

    /// Why a submitted run cannot be written, if it cannot.
    fn check_submit(&self, tokens: &[u32], kv: &HostKv) -> Option<String> {
        if let Err(err) = self.config.layout.expect(kv.layout()) {
            return Some(err.to_string());
        }
        if kv.tokens() == 0 {
            return Some("an empty run".into());
        }
        if !kv.start().is_multiple_of(self.config.block_tokens) {
            return Some(format!(
                "a run starting at {}, not a multiple of the block size {}",
                kv.start(),
                self.config.block_tokens
            ));
        }
        if kv.end() > tokens.len() {
            return Some(format!(
                "a run ending at {} with only {} tokens",
                kv.end(),
                tokens.len()
            ));
        }
        None
    }
}

impl PrefixStore for TieredStore {
    fn fingerprint(&self) -> Fingerprint {
        self.core.config.fingerprint
    }

    fn layout(&self) -> &KvLayout {
        &self.core.config.layout
    }

    fn block_tokens(&self) -> usize {
        self.core.config.block_tokens
    }

    fn known_prefix(&self, namespace: &Namespace, tokens: &[u32]) -> usize {
        self.core.known_prefix(namespace, tokens)
    }

    fn known_from(&self, namespace: &Namespace, tokens: &[u32], from: usize) -> usize {
        self.core.known_from(namespace, tokens, from).max(from)
    }

    fn fetch(
        &self,
        namespace: &Namespace,
        tokens: &[u32],
        from: usize,
        deadline: Duration,
    ) -> Option<Fetched> {
        self.core.fetch(namespace, tokens, from, deadline)
    }

    /// [`TieredStore::try_submit`].
    fn submit(&self, namespace: &Namespace, tokens: &[u32], kv: HostKv) -> Submitted {
        self.try_submit(namespace, tokens, kv)
    }

    /// [`TieredStore::try_submit_states`].
    fn submit_states(
        &self,
        namespace: &Namespace,
        tokens: &[u32],
        states: Vec<(usize, HostState)>,
    ) -> Submitted {
        self.try_submit_states(namespace, tokens, states)
    }

    fn fetch_states(
        &self,
        namespace: &Namespace,
        tokens: &[u32],
        deadline: Duration,
    ) -> Option<Vec<(usize, HostState)>> {
        self.core.fetch_states(namespace, tokens, deadline)
    }
}
