//! Sequence export and import (llama.cpp's per-sequence state get and set): one
//! sequence's keys and values over a range of positions, copied out of a cache
//! into a compact host value, and written into a sequence of any cache with the
//! same layout, in this process or another.
//!
//! The host value is a [`HostKv`] in its canonical form (per layer, keys
//! `[kv_heads, tokens, head_dim]` then values `[kv_heads, tokens, head_dim_v]`),
//! so caches with [`VLayout::Normal`](kvcache_api::VLayout::Normal) and
//! [`VLayout::Permuted`](kvcache_api::VLayout::Permuted) values exchange states
//! freely. A [`Fingerprint`] names the model: a state is only imported into a
//! cache of the same model.
//!
//! The host value is in the cache's compute dtype
//! ([`CausalConfig::dtype`](kvcache_api::CausalConfig::dtype)) whatever the
//! storage type ([`CausalConfig::storage`](kvcache_api::CausalConfig::storage)):
//! a `q8_0` (or f16-stored) cache exports its keys and values decoded, and an
//! import stores them as a forward pass's `put` would, quantizing them. So states
//! move between caches of different storage types, and the prefix store keeps
//! float rows.
//!
//! # Placement and sliding windows
//!
//! An import is placed as a forward pass over the imported positions would be: the
//! cache's placement (scattered, or one contiguous run, compacting first when
//! needed) chooses the cells, and an import may be longer than `max_batch`.
//! Sequences are trimmed to their sliding-window memory as in a pass, the
//! importing sequence as after a pass whose last token is the last imported
//! position: it keeps its positions from `end - memory` on (`end` one past the
//! last imported position), so it can continue at `end`, or re-evaluate `end - 1`.
//! Imported positions below that line are skipped, never stored. Without a
//! sliding window every imported position is stored. Imported cells are ordinary
//! cells: the next pass's mask treats them exactly like computed ones.
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use kvcache_api::{Batch, CausalCache, CausalConfig, ForwardMode, VLayout};
//! use kvcache_causal::CausalKvCache;
//!
//! let mut a = CausalKvCache::new(CausalConfig::new(2, 64, 8), Device::Cpu, None)?;
//! a.start_forward(&Batch::sequence(0, 0, 4)?, ForwardMode::Compute)?;
//! let kv = Tensor::ones((4, 2, 16), DType::F32, &Device::Cpu).unwrap(); // [batch, kv_heads, head_dim]
//! a.put(&kv, &kv)?; // layer 0
//! let state = a.export_seq(0, 1..4)?;
//! assert_eq!(state.kv.layer(0).keys.len(), 2 * 3 * 16 * 4); // [kv_heads, tokens, head_dim] of f32
//!
//! // Another cache of the same model, values stored permuted.
//! let config = CausalConfig::new(1, 64, 8).with_v_layout(VLayout::Permuted);
//! let mut b = CausalKvCache::new(config, Device::Cpu, None)?;
//! b.import_seq(0, &state)?;
//! assert_eq!(b.positions(0).iter().map(|p| p.0).collect::<Vec<_>>(), [1, 2, 3]);
//! assert_eq!(b.export_seq(0, 1..4)?, state);
//! # Ok::<(), kvcache_api::CacheError>(())
//! ```

use std::ops::Range;

use kvcache_api::{CacheError, Fingerprint, HostKv, KvLayout, Pos, Result, SeqId, SeqKv};

use crate::book::transfer::ImportPlan;
use crate::cache::CausalKvCache;
use crate::storage::{HeadDims, Uploaded};

impl CausalKvCache {
    /// Sets the model fingerprint that exported states carry and imported states
    /// must match (all zeros until set). Clones copy it and
    /// [`configure`](kvcache_api::CausalCache::configure) keeps it.
    pub fn set_fingerprint(&mut self, fingerprint: Fingerprint) {
        self.fingerprint = fingerprint;
    }

    /// The model fingerprint (all zeros until set).
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// The layout of the stored keys and values: the number of layer slots, the
    /// head dimensions of the first stored layer (keys `[cells, kv_heads,
    /// head_dim]`, values `[.., head_dim_v]`) and the configured dtype. `None`
    /// before any layer has storage.
    pub fn kv_layout(&self) -> Option<KvLayout> {
        self.storage.kv_layout(self.book.config().dtype)
    }

    /// Copies positions `range` of `seq`, every layer's keys and values, into a
    /// compact host value: `kv` holds keys `[kv_heads, range.len(), head_dim]` and
    /// values `[kv_heads, range.len(), head_dim_v]` per layer, token offset =
    /// position. Changes nothing. It reads what the layers store: in the middle of
    /// a pass, layers not yet `put` still hold older data in the pass's cells.
    ///
    /// # Errors
    /// [`CacheError::SequenceOutOfRange`] for an unknown `seq`;
    /// [`CacheError::InvalidArgument`] for an empty or negative `range`, or one
    /// with a position `seq` does not hold; [`CacheError::InvalidState`] when
    /// no layer has storage, a layer below a stored one has none (a cache that is
    /// one group of a [`crate::LayerGroupCache`]) or layers differ in head
    /// dimensions; [`CacheError::Backend`] if a tensor copy fails.
    pub fn export_seq(&self, seq: SeqId, range: Range<Pos>) -> Result<SeqKv> {
        self.export_layers(seq, range, &self.storage.all_layers())
    }

    /// Writes `state` into sequence `seq` at positions `state.kv.start() ..
    /// state.kv.end()`, placed as a forward pass would place them (see the
    /// [module docs](crate::transfer) for sliding windows), and ends any pass in
    /// progress. `seq` must be empty or end exactly at `state.kv.start()`. A cache
    /// with no layer storage yet creates every layer from the state's layout.
    ///
    /// # Errors
    /// Each leaves the cache unchanged.
    /// [`CacheError::SequenceOutOfRange`] for an unknown `seq`;
    /// [`CacheError::LayoutMismatch`] when the state's fingerprint is not the
    /// cache's (`what` = `"model"`), its dtype not the configured one, or its
    /// layer count or head dimensions not those of the stored layers;
    /// [`CacheError::InvalidArgument`] for a state with no tokens, positions past
    /// `Pos::MAX - 1`, or a `seq` that neither is empty nor ends at the state's
    /// start; [`CacheError::Full`] when the kept positions do not fit even after
    /// trimming windows. [`CacheError::Backend`] if a tensor copy fails (after
    /// validation, as in a forward pass).
    pub fn import_seq(&mut self, seq: SeqId, state: &SeqKv) -> Result<()> {
        let prepared = self.prepare_import(seq, state, None)?;
        self.commit_import(prepared)
    }

    /// Copies positions `range` of `seq` in layers `layers` (in that order)
    /// into a host value, as [`export_seq`](Self::export_seq) does for every
    /// layer: one part of a [`crate::LayerGroupCache`]. Each of `layers`
    /// must have storage, all with the same head dimensions.
    pub(crate) fn export_layers(&self, seq: SeqId, range: Range<Pos>, layers: &[usize]) -> Result<SeqKv> {
        let runs = self.book.cells_of_range(seq, range.clone())?;
        let layout = self.storage.export_layout(self.book.config().dtype, layers)?;
        let start = usize::try_from(range.start).expect("validated: not negative");
        let mut kv = HostKv::zeroed(layout, start, range.len());
        self.storage.read_rows(&runs, &mut kv, layers)?;
        Ok(SeqKv {
            fingerprint: self.fingerprint,
            kv,
        })
    }

    /// Validates importing `state` into `seq` and uploads its rows, as
    /// [`import_seq`](Self::import_seq) does, into every layer (`layers`
    /// `None`) or into `layers` (state layer `i` into layer `layers[i]`);
    /// changes nothing. [`commit_import`](Self::commit_import) stores it.
    pub(crate) fn prepare_import(
        &mut self,
        seq: SeqId,
        state: &SeqKv,
        layers: Option<&[usize]>,
    ) -> Result<PreparedImport> {
        let config = self.book.config();
        if seq >= config.max_sequences {
            return Err(CacheError::SequenceOutOfRange {
                seq,
                max_sequences: config.max_sequences,
            });
        }
        if state.fingerprint != self.fingerprint {
            return Err(CacheError::LayoutMismatch {
                what: "model",
                expected: self.fingerprint.to_hex(),
                got: state.fingerprint.to_hex(),
            });
        }
        let dtype = config.dtype;
        let layout = *state.kv.layout();
        let layers = match layers {
            None => {
                self.storage.check_import_layout(&layout, dtype)?;
                (0..layout.layers).collect()
            }
            Some(layers) => {
                self.storage
                    .check_import_layout_of(&layout, dtype, layers.len())?;
                layers.to_vec()
            }
        };
        if state.kv.tokens() == 0 {
            return Err(CacheError::InvalidArgument(
                "the state holds no tokens: nothing to import".into(),
            ));
        }
        let positions = state.positions()?;
        let plan = self.book.prepare_import(seq, positions)?;
        // The uploads come before any change: only the data writes of the
        // cells chosen can fail after them.
        let uploaded = self.storage.upload_rows(&state.kv, plan.rows.clone())?;
        Ok(PreparedImport {
            plan,
            uploaded,
            layers,
            dims: (layout.kv_heads, layout.head_dim, layout.head_dim_v),
        })
    }

    /// Stores a prepared import: creates the layers it needs, places its
    /// rows (trimming windows, compacting) and ends any pass in progress.
    /// Only a tensor write can fail ([`CacheError::Backend`]).
    pub(crate) fn commit_import(&mut self, prepared: PreparedImport) -> Result<()> {
        self.storage.ensure_layers(&prepared.layers, prepared.dims)?;
        let placed = self.book.commit_import(&prepared.plan);
        self.storage.apply_moves(&placed.moves)?;
        self.storage
            .write_uploaded(&prepared.uploaded, &placed.cells, &prepared.layers)
    }
}

/// An import validated and uploaded, not yet stored.
#[derive(Debug)]
pub(crate) struct PreparedImport {
    plan: ImportPlan,
    uploaded: Vec<Uploaded>,
    layers: Vec<usize>,
    dims: HeadDims,
}
