//! [`StorePart`] and [`StoreParts`]: a cache whose layers a prefix store keeps
//! apart, one store per part.
//!
//! A model whose layers all see every earlier position (a Llama) is stored
//! whole: one part, every position of a prompt from 0 ([`StorePart::whole`]).
//! A sliding-window model (Gemma 3) is not: its global layers need every
//! position before a prompt's end, its window layers only the window before
//! it, and they keep no more than their window memory. So each kind of
//! layer is a part with a store of its own (its own fingerprint, so neither
//! part, nor another model, ever reads the other's blocks):
//!
//! - a part **without a window** is written and restored as a whole model
//!   is: every block from position 0;
//! - a part **with a window** writes the *tail* of a prompt, the blocks
//!   within its memory before the prompt's end, and restores a prompt up to
//!   an end `e` only with a stored run that covers what a query at `e`
//!   needs (`e - window + 1 .. e`).
//!
//! A restore ([`StoreParts::restore`]) thus ends at the longest point every
//! part can serve: the parts without a window say how far the prompt is
//! stored; each window part then looks for a run over the window before
//! that point (a few block steps back at most, to the end of an earlier
//! write, such as the prompt the stored answer followed).
//!
//! Plain Rust, no tensors: the cache exports and imports the parts
//! ([`CausalCache::store_parts`](crate::CausalCache::store_parts)).

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::host::{Fingerprint, HostKv, KvLayout, Namespace, PrefixStore, SeqKv};
use crate::{CacheError, Result, StoreClient, StoreCounters, WriteBack};

/// One part of a cache's layers that a prefix store keeps apart from the
/// others (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StorePart {
    /// The model's layers in the part, ascending; `None`: every layer (the
    /// cache is stored whole).
    pub layers: Option<Vec<usize>>,
    /// The window of the part's layers: a query at position `p` sees
    /// positions `p - window + 1 ..= p`. `None`: every position before it.
    pub window: Option<usize>,
    /// Positions a sequence keeps in this part below its next one (its
    /// window memory, at least the window): a write-back reads no position
    /// below `len - memory + 1`. `None`: every position is kept.
    pub memory: Option<usize>,
}

impl StorePart {
    /// Every layer, every position: a cache stored whole.
    pub fn whole() -> Self {
        StorePart {
            layers: None,
            window: None,
            memory: None,
        }
    }

    /// The layers `layers` of a model, seeing `window` positions (`None`:
    /// all) and keeping `memory` (`None`: all).
    pub fn layers(layers: Vec<usize>, window: Option<usize>, memory: Option<usize>) -> Self {
        StorePart {
            layers: Some(layers),
            window,
            memory,
        }
    }

    /// The fingerprint of this part's entries in a store of the model
    /// `model`: the model's own for a whole cache; otherwise a SHA-256 over
    /// a domain tag, the model's fingerprint, the part's layers and window,
    /// so a part never reads another part's blocks, nor another model's.
    pub fn fingerprint(&self, model: Fingerprint) -> Fingerprint {
        let Some(layers) = &self.layers else {
            return model;
        };
        let mut hasher = Sha256::new();
        hasher.update(b"kvcache-rs store part v1");
        hasher.update(model.0);
        hasher.update((layers.len() as u64).to_le_bytes());
        for &layer in layers {
            hasher.update((layer as u64).to_le_bytes());
        }
        hasher.update((self.window.unwrap_or(0) as u64).to_le_bytes());
        Fingerprint(hasher.finalize().into())
    }

    /// The layout of this part's rows in a model whose every layer has
    /// `whole`'s shape.
    pub fn layout(&self, whole: KvLayout) -> KvLayout {
        KvLayout {
            layers: self.layers.as_ref().map_or(whole.layers, Vec::len),
            ..whole
        }
    }

    /// The first position a query at `end` needs in this part (0 without a
    /// window).
    pub fn first_needed(&self, end: usize) -> usize {
        self.window.map_or(0, |w| (end + 1).saturating_sub(w))
    }

    /// The first position of a sequence of `len` positions that this part
    /// still keeps (0 without a memory).
    pub fn first_kept(&self, len: usize) -> usize {
        self.memory.map_or(0, |m| (len + 1).saturating_sub(m))
    }
}

/// What [`StoreParts::restore`] found: for every part, the keys and values
/// of the prompt up to `end`, each part from where it is needed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartsFetched {
    /// The restore's end: positions `from..end` of the prompt come back.
    pub end: usize,
    /// One state per part, in the parts' order: a part without a window
    /// from `from`, a window part from where its run starts (at most where a
    /// query at `end` needs it, or `from`).
    pub parts: Vec<SeqKv>,
    /// `(tier name, tokens)` of the tiers that served `from..end` of the
    /// first part without a window.
    pub tiers: Vec<(&'static str, usize)>,
}

/// How far back a window part looks for a run over the window before a
/// restore's end: block steps below the first one tried.
const WINDOW_PROBES: usize = 8;

/// The prefix stores of a cache, one per [`StorePart`], and the rules of
/// restoring and writing back across them (see the [module docs](self)).
/// Cheap to clone.
#[derive(Clone, Debug)]
pub struct StoreParts {
    model: Fingerprint,
    parts: Vec<(StorePart, StoreClient)>,
    /// The first part without a window: it counts restores and gives the
    /// tiers.
    lead: usize,
}

impl StoreParts {
    /// One store for a cache stored whole.
    pub fn whole(client: StoreClient) -> Self {
        StoreParts {
            model: client.fingerprint(),
            parts: vec![(StorePart::whole(), client)],
            lead: 0,
        }
    }

    /// The stores of the model `model`'s parts, each read within `deadline`.
    ///
    /// # Errors
    /// [`InvalidArgument`](CacheError::InvalidArgument) for no parts, or no
    /// part without a window (nothing would say how far a prompt is
    /// stored); [`LayoutMismatch`](CacheError::LayoutMismatch) (`what` =
    /// `"model"`) for a store whose fingerprint is not its part's
    /// ([`StorePart::fingerprint`]).
    pub fn new(
        model: Fingerprint,
        parts: Vec<(StorePart, Arc<dyn PrefixStore>)>,
        deadline: Duration,
    ) -> Result<Self> {
        let lead = parts
            .iter()
            .position(|(part, _)| part.window.is_none())
            .ok_or_else(|| {
                CacheError::InvalidArgument(
                    "store parts need one part that keeps every position (none given)".into(),
                )
            })?;
        for (i, (part, store)) in parts.iter().enumerate() {
            let want = part.fingerprint(model);
            if store.fingerprint() != want {
                return Err(CacheError::LayoutMismatch {
                    what: "model",
                    expected: format!("part {i}: {}", want.to_hex()),
                    got: store.fingerprint().to_hex(),
                });
            }
        }
        let parts = parts
            .into_iter()
            .map(|(part, store)| (part, StoreClient::new(store, deadline)))
            .collect();
        Ok(StoreParts { model, parts, lead })
    }

    /// The model the stores belong to.
    pub fn model(&self) -> Fingerprint {
        self.model
    }

    /// The parts and their clients, in order.
    pub fn parts(&self) -> impl Iterator<Item = (&StorePart, &StoreClient)> {
        self.parts.iter().map(|(part, client)| (part, client))
    }

    /// The parts alone, in order (what a cache's
    /// [`store_parts`](crate::CausalCache::store_parts) must equal).
    pub fn layout(&self) -> Vec<StorePart> {
        self.parts.iter().map(|(part, _)| part.clone()).collect()
    }

    /// The client of the first part without a window: restores are counted
    /// there.
    pub fn lead(&self) -> &StoreClient {
        &self.parts[self.lead].1
    }

    /// The counters of every part together: restores as the lead part
    /// counts them (one per prompt, its tokens once); writes, refusals and
    /// errors of every part.
    pub fn counters(&self) -> StoreCounters {
        let mut total = self.lead().counters();
        for (i, (_, client)) in self.parts.iter().enumerate() {
            if i == self.lead {
                continue;
            }
            let c = client.counters();
            total.restore_time += c.restore_time;
            total.rejected += c.rejected;
            total.writes += c.writes;
            total.written_tokens += c.written_tokens;
            total.refused += c.refused;
            total.write_errors += c.write_errors;
        }
        total
    }

    /// The keys and values the parts hold for `prompt` past `from` (the
    /// caller's cache holds `[0, from)` in every part: in a window part, at
    /// least the window before `from`), up to the longest end `e` every
    /// part can serve, never the prompt's last token (`from < e <
    /// prompt.len()`). `Ok(None)` when some part holds nothing there.
    ///
    /// # Errors
    /// An answer that does not fit (see [`StoreClient::restore`]); an empty
    /// prompt is an [`InvalidArgument`](CacheError::InvalidArgument) error.
    pub fn restore(
        &self,
        namespace: &Namespace,
        prompt: &[u32],
        from: usize,
    ) -> Result<Option<PartsFetched>> {
        if self.parts.len() == 1 {
            let client = self.lead();
            return Ok(client
                .restore(namespace, prompt, from)?
                .map(|fetched| PartsFetched {
                    end: fetched.kv.end(),
                    parts: vec![client.seq_state(fetched.kv)],
                    tiers: fetched.tiers,
                }));
        }
        let mut runs: Vec<Option<HostKv>> = vec![None; self.parts.len()];
        let mut tiers = Vec::new();
        let mut end = usize::MAX;
        for (i, (part, client)) in self.parts.iter().enumerate() {
            if part.window.is_some() {
                continue;
            }
            let Some(fetched) = client.restore(namespace, prompt, from)? else {
                return Ok(None);
            };
            end = end.min(fetched.kv.end());
            if i == self.lead {
                tiers = fetched.tiers;
            }
            runs[i] = Some(fetched.kv);
        }
        for (i, (part, client)) in self.parts.iter().enumerate() {
            if part.window.is_none() {
                continue;
            }
            let Some(kv) = self.window_run(part, client, namespace, prompt, from, end)? else {
                return Ok(None);
            };
            end = end.min(kv.end());
            runs[i] = Some(kv);
        }
        // A later part may have ended the restore earlier: every window
        // part must still cover what a query at the end needs.
        let fits = self.parts.iter().zip(&runs).all(|((part, _), kv)| {
            let start = kv.as_ref().expect("every part fetched").start();
            start == from || start <= part.first_needed(end)
        });
        if end <= from || !fits {
            return Ok(None);
        }
        let parts = self
            .parts
            .iter()
            .zip(runs)
            .map(|((_, client), kv)| {
                let kv = kv.expect("every part fetched");
                Ok(client.seq_state(kv.slice(kv.start()..end)?))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(PartsFetched {
            end,
            parts,
            tiers: clip_tiers(tiers, end - from),
        }))
    }

    /// A window part's stored run of `prompt` over the window before some
    /// end at most `end`: from `from` when the cache holds the window
    /// before it; otherwise from the block where a query at `end` needs
    /// the part, stepping back a block at a time while the run found is
    /// too short to be resumed anywhere.
    fn window_run(
        &self,
        part: &StorePart,
        client: &StoreClient,
        namespace: &Namespace,
        prompt: &[u32],
        from: usize,
        end: usize,
    ) -> Result<Option<HostKv>> {
        if from > 0 {
            return Ok(client.restore(namespace, prompt, from)?.map(|f| f.kv));
        }
        let block = client.block_tokens();
        let mut start = part.first_needed(end) / block * block;
        for _ in 0..=WINDOW_PROBES {
            if let Some(fetched) = client.restore(namespace, prompt, start)? {
                let reach = end.min(fetched.kv.end());
                if start <= part.first_needed(reach) {
                    return Ok(Some(fetched.kv));
                }
            }
            if start == 0 {
                break;
            }
            start -= block;
        }
        Ok(None)
    }

    /// The reader took `fetched` (counted once, by the lead part).
    pub fn record_restored(&self, from: usize, fetched: &PartsFetched) {
        self.lead().record_restored(fetched.end - from, &fetched.tiers, 0);
    }

    /// The reader could not take a restore.
    pub fn record_rejected(&self) {
        self.lead().record_rejected();
    }

    /// A write-back's rows could not be read as the store's model.
    pub fn record_write_failed(&self) {
        self.lead().record_write_failed();
    }

    /// Writes back the evaluated `prompt` to every part: a part without a
    /// window what its store lacks ([`StoreClient::write_back`]), a window
    /// part what its store lacks of the tail the cache keeps
    /// ([`StoreClient::write_from`] from [`StorePart::first_kept`], or from
    /// `held(part)`, the first position the cache holds in that part, when
    /// it holds less). `rows(part, range)` reads the part's keys and values
    /// of `range` from the cache. Returns what each part did, in order;
    /// stops at the first error (the parts before it are written).
    pub fn write_back<E>(
        &self,
        namespace: &Namespace,
        prompt: &[u32],
        held: impl Fn(usize) -> usize,
        mut rows: impl FnMut(usize, Range<usize>) -> std::result::Result<HostKv, E>,
    ) -> std::result::Result<Vec<WriteBack>, E>
    where
        E: From<CacheError>,
    {
        self.parts
            .iter()
            .enumerate()
            .map(|(i, (part, client))| {
                let first = match part.window {
                    None => 0,
                    Some(_) => part.first_kept(prompt.len()).max(held(i)),
                };
                client.write_from(namespace, prompt, first, |range| rows(i, range))
            })
            .collect()
    }
}

/// The first `tokens` of what `tiers` served, in order.
fn clip_tiers(tiers: Vec<(&'static str, usize)>, mut tokens: usize) -> Vec<(&'static str, usize)> {
    tiers
        .into_iter()
        .filter_map(|(tier, n)| {
            let n = n.min(tokens);
            tokens -= n;
            (n > 0).then_some((tier, n))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_whole_part_is_the_model_and_window_parts_differ_by_layers_and_window() {
        let model = Fingerprint([7; 32]);
        assert_eq!(StorePart::whole().fingerprint(model), model);
        let global = StorePart::layers(vec![5, 11], None, None);
        let window = StorePart::layers(vec![0, 1, 2], Some(512), Some(640));
        let fingerprints = [
            global.fingerprint(model),
            window.fingerprint(model),
            StorePart::layers(vec![0, 1, 2], Some(256), Some(640)).fingerprint(model),
            StorePart::layers(vec![0, 1], Some(512), Some(640)).fingerprint(model),
            global.fingerprint(Fingerprint([8; 32])),
        ];
        for (i, a) in fingerprints.iter().enumerate() {
            assert_ne!(*a, model);
            for b in &fingerprints[i + 1..] {
                assert_ne!(a, b);
            }
        }
        // The memory is no part of it: it only says what a cache keeps.
        let roomier = StorePart::layers(vec![0, 1, 2], Some(512), Some(1024));
        assert_eq!(roomier.fingerprint(model), window.fingerprint(model));
    }

    #[test]
    fn a_window_part_needs_the_window_before_an_end_and_keeps_its_memory() {
        let part = StorePart::layers(vec![0], Some(4), Some(6));
        // A query at 10 sees 7..=10.
        assert_eq!(part.first_needed(10), 7);
        assert_eq!(part.first_needed(2), 0);
        // A sequence of 10 positions (next one 10) keeps 5..10.
        assert_eq!(part.first_kept(10), 5);
        assert_eq!(StorePart::whole().first_kept(10), 0);
        let layout = KvLayout::new(18, 1, 8, crate::DType::F32);
        assert_eq!(part.layout(layout).layers, 1);
        assert_eq!(StorePart::whole().layout(layout), layout);
    }

    #[test]
    fn clipped_tiers_keep_their_order() {
        let tiers = vec![("memory", 4), ("disk", 6)];
        assert_eq!(clip_tiers(tiers.clone(), 7), vec![("memory", 4), ("disk", 3)]);
        assert_eq!(clip_tiers(tiers.clone(), 3), vec![("memory", 3)]);
        assert_eq!(clip_tiers(tiers, 20), vec![("memory", 4), ("disk", 6)]);
    }
}
