//! A multi-sequence causal KV cache on candle tensors: the design of Ollama's
//! `kvcache.Causal`, with its bookkeeping made fast and its defects fixed.
//!
//! The cache is a pool of *cells*; each holds one token's keys and values for every
//! layer, that token's position, and the set of sequences sharing it. Per forward
//! pass an engine calls `start_forward` with the batch, then per layer `put` and
//! `get` (see [`kvcache_api::CausalCache`]). Between passes it edits sequences with
//! `remove` (shifting later positions through a [`KeyShift`](kvcache_api::KeyShift)
//! such as [`RopeShift`]) and `copy_prefix` (sharing cells, no tensor copy).
//!
//! # Design
//!
//! The bookkeeping is plain Rust, separate from the tensors:
//!
//! - each cell's sequences are a fixed-width bitset, and used cells another bitset
//!   searched 64 cells at a time;
//! - each sequence keeps a sorted index of *runs* (consecutive positions in
//!   consecutive cells), so trimming a sliding window, removing a range, copying a
//!   prefix and building a mask row cost a step per run, not per cell;
//! - masks are written row by row as fills of `-inf` and `0` over those runs, in the
//!   mask dtype directly (f32, f16 or bf16), into a buffer reused from pass to pass
//!   (on the CPU a forward pass allocates nothing once the buffer has grown);
//! - compaction (contiguous placement, or holes above
//!   [`compact_threshold`](kvcache_api::CausalConfig::compact_threshold)) slides used
//!   cells down in order and moves keys, values and metadata in step. Ollama's defrag
//!   can leave K/V data swapped against the recorded positions; here a test checks
//!   every cell after compaction.
//!
//! Every operation validates its input before changing anything: a rejected call
//! returns a typed [`CacheError`](kvcache_api::CacheError) and leaves the cache
//! exactly as it was ([`CausalKvCache::picture`] lets tests prove it), and
//! [`CausalKvCache::check`] verifies every invariant.
//!
//! [`CausalKvCache::export_seq`] copies one sequence's keys and values over a range
//! of positions into a compact host [`SeqKv`], and [`CausalKvCache::import_seq`]
//! writes one into a sequence of any cache of the same model and layout (llama.cpp's
//! per-sequence state get and set; see [`transfer`]).
//!
//! [`LayerGroupCache`] drives one cache per group of layers (sliding-window and
//! global layers, as in Gemma 3) as a single cache.
//!
//! [`layer_cache`] is the other design on candle: per-layer caches of one live
//! sequence, pageable to snapshots, that `kvcache_trie::PrefixCache` drives
//! (an engine on candle uses the prefix trie through them).
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use kvcache_api::{Batch, CausalCache, CausalConfig, ForwardMode};
//! use kvcache_causal::CausalKvCache;
//!
//! let mut cache = CausalKvCache::new(CausalConfig::new(1, 16, 16), Device::Cpu, None)?;
//! cache.start_forward(&Batch::sequence(0, 0, 3)?, ForwardMode::Compute)?;
//! cache.set_layer(0);
//! let kv = Tensor::zeros((3, 1, 4), DType::F32, &Device::Cpu).unwrap(); // [batch, kv_heads, head_dim]
//! cache.put(&kv, &kv)?;
//! let view = cache.get()?;
//! let mask = view.mask.to_vec2::<f32>().unwrap(); // [batch, cells]
//! assert_eq!(mask[0], [0.0, f32::NEG_INFINITY, f32::NEG_INFINITY]);
//! assert_eq!(mask[2], [0.0, 0.0, 0.0]);
//! # Ok::<(), kvcache_api::CacheError>(())
//! ```
#![deny(missing_docs)]

mod blocks;
mod book;
mod cache;
mod cells;
mod inspect;
pub mod layer_cache;
mod layer_groups;
mod mask;
mod mask_buffer;
mod occupancy;
mod placement;
mod rope;
mod seq_index;
mod seq_set;
mod storage;
pub mod transfer;
mod window;

pub use cache::{key_shift, CausalKvCache, SharedKeyShift};
pub use inspect::{CachePicture, CellData, CellInfo, LayerData, PassPicture};
pub use kvcache_api::SeqKv;
pub use layer_groups::LayerGroupCache;
pub use rope::{RopeLayout, RopeShift};
pub use storage::MAX_LAYERS;
