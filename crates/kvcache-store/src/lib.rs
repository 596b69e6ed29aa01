//! A tiered, content-addressed store of KV-cache prefixes that outlives the
//! process: host memory, a local directory and Redis, behind
//! [`kvcache_api::PrefixStore`].
//!
//! # Design
//!
//! **Blocks and keys** ([`keys`]). A prompt's keys and values are stored in
//! blocks of `block_tokens` tokens (256 by default), as in vLLM's prefix
//! caching. The key of a block is a SHA-256 over a domain tag, the model
//! [`Fingerprint`](kvcache_api::Fingerprint), the [`Namespace`](kvcache_api::Namespace)
//! (tagged and length-prefixed, see [`namespace`]), the previous block's key
//! (zeros for the first), and the block's token count and tokens. A key thus
//! names the whole prefix up to its block's end, within one model and one
//! tenant: prefixes never cross namespaces, and another model's entries are
//! never restored.
//!
//! **Tails.** The last block of a submitted run may be partial: a restored
//! conversation gets back all of what was stored, not just whole blocks. A tail
//! is keyed like a block over its shorter token list. Every tier keeps a *tails
//! index*: for a parent key (the block before the tail, or [`BlockKey::ROOT`]),
//! the tail lengths stored after it.
//!
//! **Lookup** ([`TieredStore`]'s `fetch`). Walk the full-block keys from the
//! block containing `from` (hashing only, no I/O) while blocks are found, then
//! ask the tails index of the last key found for tails, longest first, and take
//! the first whose key (over the prompt's own tokens) is stored. A prompt that
//! diverges inside a stored tail gets the full blocks before it only: a tail is
//! served whole or not at all. The answer is `[from, end)`.
//!
//! Two ways to read it. When every tier can say what it holds without I/O
//! ([`Tier::holds`]: memory and disk), the fetch first *plans* the blocks, then
//! builds the answer in its own order (layer, keys then values, head, block)
//! straight from each block's [`RowReader`] (a file read into place, its CRC32
//! checked on the way): one copy, as a plain file read. Otherwise (a Redis
//! tier), or when the plan does not hold up (a file vanished or failed its
//! checks), each block is read whole, tier by tier, fastest first, and the
//! blocks are joined in one copy. Either way a block found in a slower tier is
//! promoted into the in-memory tier, and the caller's deadline bounds the whole
//! fetch: it is checked between blocks, tiers and layers and passed to Redis as
//! the socket timeout; on timeout or error the fetch answers what it found so
//! far.
//!
//! **Whole states** ([`states`]). Layers that cannot cut their state into
//! token rows (rotating windows, recurrent states) are stored whole, at the
//! end of a prompt (`submit_states` / `fetch_states`): one entry per prefix,
//! keyed by the prefix's last key in the block chain under a domain tag of its
//! own, encoded with a checksum and carried by ordinary blocks, so every tier
//! stores, budgets, evicts and checks them as it does rows. They are served
//! only for exactly the prefix they stand at.
//!
//! **Writes** (the writer). `submit` validates, copies the tokens and queues
//! the run for a background thread through a bounded queue of
//! [`StoreConfig::queue_capacity`] writes; the caller never blocks. A full
//! queue drops the run, and says so where it happens:
//! [`TieredStore::try_submit`] returns [`Submitted::Dropped`], the drop is
//! counted ([`StoreStats::dropped`]) and logged (a rate-limited `warn`). The writer keys the run's
//! blocks ([`RunBlock`]: a key and a token range of the run, no copy) and
//! writes to every tier the blocks it lacks (write-through), as one batch per
//! tier ([`Tier::put_run`]). The disk tier writes each block's file straight
//! from the run (vectored writes of its row slices, the CRC over the same
//! slices), syncs a group of files side by side and its directory once, and
//! removes the files its budget displaces on a thread of its own meanwhile;
//! blocks are cut into memory once, only for tiers that keep them (memory,
//! Redis). [`TieredStore::flush`] waits for the queue; dropping the store
//! finishes it and joins the thread.
//!
//! **Tiers** ([`Tier`]), each with its own LRU and budget:
//!
//! - [`MemoryTier`]: a map of shared blocks under a byte budget.
//! - [`DiskTier`]: one safetensors file per block (`layers.{i}.keys`,
//!   `layers.{i}.values` in the real dtype, readable by any safetensors tool;
//!   metadata with the keys, layout, fingerprint, namespace and a CRC32), written
//!   to a temporary name, synced, renamed, the directory synced. The index is
//!   rebuilt from the headers at open. A damaged or truncated file is a miss,
//!   removed and counted, never wrong data.
//! - [`RedisTier`]: chunked values with a manifest, a SET per parent for tails,
//!   optional TTL; Redis's own `maxmemory` with `allkeys-lru` is the budget. A
//!   lost connection is an error counted, and the next call reconnects (after
//!   a short back-off, during which calls fail at once).
//!
//! **Knowing without I/O.** `known_prefix` answers from the keys this process
//! wrote or read (forgotten when every tier misses them); `known_from` the
//! same from a later block, for a sliding-window part of a cache that
//! stores a prompt's tail, not its start (`kvcache_api::StoreParts`).
//!
//! **Statistics** ([`StoreStats`]): per tier hits, misses, errors, corrupt
//! entries removed, evictions, bytes and usage; writes submitted, dropped and
//! rejected; fetch timeouts.
//!
//! Benchmark S1 (`benches/store.rs`) measures put and get of a 1,024-token
//! SmolLM2 prefix per tier against a memcpy, a plain file write/read and raw
//! Redis SET/GET of the same bytes.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use kvcache_api::{DType, Fingerprint, HostKv, KvLayout, Namespace, PrefixStore};
//! use kvcache_store::{MemoryTier, StoreConfig, TieredStore};
//!
//! let layout = KvLayout::new(2, 1, 4, DType::F32);
//! let config = StoreConfig::new(Fingerprint([1; 32]), layout).with_block_tokens(4);
//! let memory = MemoryTier::new(config.context(), 1 << 20);
//! let store = TieredStore::new(config, vec![Box::new(memory)])?;
//!
//! let tenant = Namespace::new("tenant-1")?;
//! let tokens: Vec<u32> = (100..110).collect(); // two blocks and a 2-token tail
//! let bytes: Vec<u8> = (0..10 * layout.token_bytes()).map(|i| i as u8).collect();
//! let kv = HostKv::from_bytes(layout, 0, 10, bytes)?;
//! store.submit(&tenant, &tokens, kv.clone());
//! store.flush();
//!
//! assert_eq!(store.known_prefix(&tenant, &tokens), 10);
//! let found = store.fetch(&tenant, &tokens, 3, Duration::from_secs(1)).unwrap();
//! assert_eq!(found.kv, kv.slice(3..10)?);
//! assert_eq!(found.tiers, vec![("memory", 7)]);
//! // Another namespace sees nothing.
//! assert!(store.fetch(&Namespace::shared(), &tokens, 0, Duration::from_secs(1)).is_none());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]

pub mod disk;
pub mod entry_file;
mod error;
pub mod keys;
mod known;
mod lru;
pub mod memory;
pub mod namespace;
pub mod redis_tier;
mod rows;
pub mod states;
mod stats;
mod store;
mod tails;
mod tier;
mod writer;

pub use disk::DiskTier;
pub use error::{Result, StoreError};
pub use keys::{BlockKey, KeyChain};
pub use memory::MemoryTier;
pub use namespace::{redis_prefix, Scope};
pub use redis_tier::{RedisConfig, RedisTier};
pub use stats::{StoreStats, TierCounters, TierStats};
pub use store::{StoreConfig, Submitted, TieredStore};
pub use tier::{Block, OpenRows, RowReader, RunBlock, Tier, TierContext};

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeDoctests;
