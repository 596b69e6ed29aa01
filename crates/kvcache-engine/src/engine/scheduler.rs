//! What one forward pass evaluates: decode steps first, one pending token per
//! decoding sequence, then prompt chunks in the room left, the
//! longest-waiting request first; and the context shift of a sequence that
//! reached its context before the pass.
//!
//! **Invariant:** a [`Plan`] never holds more than `max_batch` tokens, a
//! decode step never waits for a prompt, and a request's wait for a pass is
//! bounded by the prompts that joined before it.

use std::time::Instant;

use candle_core::Tensor;
use kvcache_api::{CausalCache, Pos, PosRange, SeqId};
use kvcache_models::{BatchToken, Model};

use super::{Engine, Event, Slot};
use crate::Result;

/// One sequence's part of a pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Planned {
    /// Its sequence.
    pub(super) seq: SeqId,
    /// Tokens it evaluates in the pass.
    pub(super) tokens: usize,
    /// The batch row of its last token when the pass picks its next token
    /// there (a decode step, or the chunk that completes its prompt).
    pub(super) pick_row: Option<usize>,
}

/// One forward pass: the batch and, in batch order, each sequence's part.
#[derive(Debug, Default)]
pub(super) struct Plan {
    /// The tokens to evaluate, decode steps first.
    pub(super) batch: Vec<BatchToken>,
    /// Each sequence's part, in the order of its tokens in `batch`.
    pub(super) parts: Vec<Planned>,
    /// Decode tokens at the head of `batch`.
    pub(super) decode: usize,
}

impl Plan {
    /// Decode steps first, then prompt chunks of at most `prefill_chunk`
    /// tokens, the longest-waiting request first, while `max_batch` allows.
    pub(super) fn schedule(slots: &[Option<Slot>], max_batch: usize, prefill_chunk: usize) -> Plan {
        let mut plan = Plan::default();
        // Decode steps first: one pending token each.
        for (seq, slot) in slots.iter().enumerate() {
            if plan.batch.len() == max_batch {
                break;
            }
            let Some(s) = slot else { continue };
            if s.cached + 1 == s.tokens.len() && !s.generated.is_empty() {
                plan.batch.push(BatchToken {
                    seq,
                    pos: s.cached as Pos,
                    token: s.tokens[s.cached],
                });
                plan.parts.push(Planned {
                    seq,
                    tokens: 1,
                    pick_row: Some(plan.batch.len() - 1),
                });
                plan.decode += 1;
            }
        }
        // Then prompt chunks in the room left, the longest-waiting request
        // first: a new request's wait is bounded by the prompts before it,
        // and decode steps never wait for a prompt.
        let mut prefilling: Vec<(Instant, SeqId)> = slots
            .iter()
            .enumerate()
            .filter_map(|(seq, s)| {
                s.as_ref()
                    .filter(|s| s.generated.is_empty())
                    .map(|s| (s.joined, seq))
            })
            .collect();
        prefilling.sort_unstable();
        for (_, seq) in prefilling {
            let room = max_batch - plan.batch.len();
            if room == 0 {
                break;
            }
            let s = slots[seq].as_ref().expect("a prefilling slot");
            let n = (s.tokens.len() - s.cached).min(prefill_chunk).min(room);
            for i in 0..n {
                let p = s.cached + i;
                plan.batch.push(BatchToken {
                    seq,
                    pos: p as Pos,
                    token: s.tokens[p],
                });
            }
            let completes = s.cached + n == s.tokens.len();
            plan.parts.push(Planned {
                seq,
                tokens: n,
                pick_row: completes.then(|| plan.batch.len() - 1),
            });
        }
        plan
    }

    /// Prompt tokens in the pass.
    pub(super) fn prefill(&self) -> usize {
        self.batch.len() - self.decode
    }

    /// The batch rows whose next token the pass picks, in order.
    pub(super) fn pick_rows(&self) -> Vec<u32> {
        self.parts
            .iter()
            .filter_map(|p| p.pick_row)
            .map(|r| r as u32)
            .collect()
    }
}

impl<C, M> Engine<'_, C, M>
where
    C: CausalCache<Tensor = Tensor>,
    M: Model,
{
    /// Shifts every decoding sequence that reached the context: half of the
    /// tokens after its first `keep` are dropped and the rest moved down.
    /// Returns how many shifted.
    pub(super) fn context_shifts(&mut self, on_event: &mut dyn FnMut(&Event)) -> Result<usize> {
        let Some(ctx) = self.config.context else {
            return Ok(0);
        };
        let mut n = 0;
        let mut shifted = Vec::new();
        for (seq, slot) in self.slots.iter_mut().enumerate() {
            let Some(s) = slot else { continue };
            // Only decoding sequences (one pending token) reach the limit.
            if s.cached < s.tokens.len() - 1 || s.cached < ctx {
                continue;
            }
            let keep = self.config.keep.min(s.cached);
            let discard = (s.cached - keep) / 2;
            if discard == 0 {
                continue;
            }
            let removed = keep as Pos..(keep + discard) as Pos;
            // Blocks whose cells the shift moves are no longer what their keys
            // say: the index drops them (and journals it).
            self.cache.remove(seq, PosRange::from(removed.clone()))?;
            s.tokens.drain(keep..keep + discard);
            s.cached -= discard;
            s.shifts += 1;
            shifted.push((seq, keep));
            n += 1;
            on_event(&Event::ContextShift {
                id: s.req.id,
                seq,
                removed,
            });
        }
        self.with_retention(|policy, cx| {
            for (seq, keep) in shifted {
                policy.release(cx, seq, keep);
            }
            Ok(())
        })?;
        Ok(n)
    }
}
