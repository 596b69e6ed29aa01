//! The tensor a pass's mask lives in, reused from pass to pass.
//!
//! A prefill mask is megabytes (512 queries over 8,704 cells is 17.8 MB in f32).
//! Allocating it afresh every pass costs more than writing it: each new page
//! faults and is zeroed by the kernel, and the fresh buffer is cold in cache. So
//! the mask is written into a flat tensor kept between passes, on the cache's
//! device, and the pass's mask is a `[rows, cols]` view of its prefix; the buffer
//! grows (by doubling) to hold the largest mask seen and stays there.
//!
//! Writing in place is why `get`'s mask, like its keys and values, is a view that
//! stays valid only until the next `start_forward`: a caller that keeps a mask
//! across passes must copy it.
//!
//! The buffer's content is known (the [`Plan`] last written into it), so each pass
//! writes only the entries that change (see [`crate::mask`]); a buffer freshly
//! allocated is zeroed, that is all visible, and gets only its masked entries. On
//! the CPU they are written in place. On another device the changed entries cross
//! the bus as (index, value) pairs scattered there, or, when they are most of the
//! mask (a new buffer, a new shape), the mask is written on the host and copied
//! over whole: a decode step or a repeated prefill sends a few kB, not the mask.
//!
//! Worst-case (reserve) masks span every cell and are built once when an engine
//! sizes its graphs; unless the kept buffer already fits them they get a buffer of
//! their own, dropped with the pass, so the kept buffer is sized by real passes.

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{CpuStorage, DType as CandleDType, Device, Layout, Tensor};
use half::{bf16, f16};
use kvcache_api::{CacheError, DType, ForwardMode, Result};

use crate::book::Book;
use crate::mask::{self, MaskValue, Plan};
use crate::storage::{candle_dtype, same_storage};

/// Kept buffers for the masks of successive passes.
#[derive(Debug, Default)]
pub(crate) struct MaskBuffer {
    /// A flat tensor on the cache's device whose prefix holds the current mask.
    tensor: Option<Tensor>,
    /// Other devices: host scratch for changes and whole masks sent over.
    host: Host,
    /// What the kept buffer (the tensor, or the host vector of the mask dtype)
    /// holds in its first `held.len()` entries (the tensor's every entry).
    held: Plan,
    /// Scratch for the next pass's plan.
    next: Plan,
    /// Whether a copy of the cache shares the kept tensor, which must then be
    /// replaced rather than written (atomic so that sharing needs only `&self`).
    shared: AtomicBool,
}

/// Host vectors, one per mask dtype (only the configured dtype's is ever
/// filled): scratch for what a device's buffer is sent.
#[derive(Debug, Default)]
struct Host {
    f32: Vec<f32>,
    f16: Vec<f16>,
    bf16: Vec<bf16>,
}

impl MaskBuffer {
    /// The `[mask_rows, range.len()]` mask of `book`'s pass on `device`.
    pub(crate) fn build(&mut self, book: &Book, device: &Device) -> Result<Tensor> {
        let shape = (book.mask_rows(), book.pass().range().len());
        book.plan_mask(&mut self.next);
        let reserve = book.pass().mode() == Some(ForwardMode::Reserve);
        let dtype = book.config().mask_dtype;
        let config = book.config();
        let rows = config.max_batch.div_ceil(config.batch_padding) * config.batch_padding;
        let largest = rows * book.cells().len();
        self.write_kept(dtype, reserve, largest, device)
            .and_then(|flat| flat.reshape(shape))
            .map_err(CacheError::backend)
    }

    /// A buffer for a copy of the cache whose current mask is `mask`. The copy shares
    /// that mask read-only; from now on neither side writes into this buffer again
    /// (each allocates a new one at its next pass), so the copy costs no mask copy.
    pub(crate) fn share(&self, mask: Option<&Tensor>) -> (MaskBuffer, Option<Tensor>) {
        if self.tensor.is_some() {
            self.shared.store(true, Ordering::Relaxed);
        }
        (MaskBuffer::default(), mask.cloned())
    }

    /// Makes `source_mask`, the current mask of the cache that owns `source`, this
    /// buffer's mask too: written as a difference into this buffer where the
    /// source's mask is a view of its own kept buffer (its plan is known), copied
    /// otherwise.
    pub(crate) fn copy_from(
        &mut self,
        source: &MaskBuffer,
        source_mask: Option<&Tensor>,
        dtype: DType,
    ) -> Result<Option<Tensor>> {
        let Some(mask) = source_mask else { return Ok(None) };
        let planned = matches!(&source.tensor, Some(kept) if same_storage(mask, kept));
        let copied = if planned && mask.device().is_cpu() {
            self.next.clone_from(&source.held);
            self.next.truncate(mask.elem_count());
            self.write_kept(dtype, false, 0, &Device::Cpu)
                .and_then(|flat| flat.reshape(mask.dims()))
        } else {
            mask.copy()
        };
        copied.map(Some).map_err(CacheError::backend)
    }

    /// Bytes held between passes.
    pub(crate) fn bytes(&self) -> usize {
        let tensor = self
            .tensor
            .as_ref()
            .map_or(0, |t| t.elem_count() * t.dtype().size_in_bytes());
        let host = &self.host;
        let host = host.f32.capacity() * 4 + (host.f16.capacity() + host.bf16.capacity()) * 2;
        tensor + host
    }

    /// Writes the planned mask into the kept tensor, or into a new one on
    /// `device` when it does not fit (kept unless `reserve`); returns the flat
    /// mask.
    ///
    /// A new kept tensor has room for twice the old one's entries (up to `largest`,
    /// the most a mask of the cache can have), so masks that grow pass after pass
    /// (a prefill in chunks, decoding into more cells) get a new buffer a few
    /// times, not every pass. The room past the mask is written masked at once, so
    /// it is known (only differences are written into it later) and its pages are
    /// touched when the buffer is made rather than pass after pass.
    fn write_kept(
        &mut self,
        dtype: DType,
        reserve: bool,
        largest: usize,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        if std::mem::take(self.shared.get_mut()) {
            self.tensor = None;
            self.held = Plan::default();
        }
        let len = self.next.len();
        let candle = candle_dtype(dtype);
        let fits = |t: &&Tensor| t.dtype() == candle && t.elem_count() >= len;
        if let Some(kept) = self.tensor.clone().as_ref().filter(fits) {
            write(kept, &self.held, &self.next, &mut self.host)?;
            self.next.keep_tail_of(&self.held);
            std::mem::swap(&mut self.held, &mut self.next);
            return kept.narrow(0, 0, len);
        }
        let kept = self.tensor.as_ref().filter(|t| t.dtype() == candle);
        let room = match kept {
            Some(kept) if !reserve => len.max((2 * kept.elem_count()).min(largest)),
            _ => len,
        };
        // Entries past the mask are written masked now, so that later, larger masks
        // find them known and in memory already touched.
        self.next.extend_masked(room);
        let fresh = Tensor::zeros(room, candle, device)?;
        write(&fresh, &Plan::all_visible(room), &self.next, &mut self.host)?;
        if !reserve {
            self.tensor = Some(fresh.clone());
            std::mem::swap(&mut self.held, &mut self.next);
        }
        fresh.narrow(0, 0, len)
    }
}

/// Makes the flat tensor `flat`, whose first `old.len()` entries hold the mask
/// `old`, hold `new` in its first `new.len()`: in place on the CPU, through
/// [`write_on_device`] (with `host`'s vector of the dtype) elsewhere.
fn write(flat: &Tensor, old: &Plan, new: &Plan, host: &mut Host) -> candle_core::Result<()> {
    if flat.device().is_cpu() {
        return flat.narrow(0, 0, new.len())?.inplace_op1(&WriteMask { old, new });
    }
    match flat.dtype() {
        CandleDType::F32 => write_on_device(flat, old, new, &mut host.f32)?,
        CandleDType::F16 => write_on_device(flat, old, new, &mut host.f16)?,
        CandleDType::BF16 => write_on_device(flat, old, new, &mut host.bf16)?,
        other => candle_core::bail!("mask buffer of dtype {other:?}"),
    };
    Ok(())
}

/// What [`write_on_device`] sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sent {
    /// Nothing changed.
    Nothing,
    /// This many changed entries, scattered.
    Changes(usize),
    /// The whole mask.
    Whole,
}

/// [`write`] where the buffer is not host memory: the changed entries as
/// u32 indices and values scattered into `flat` (6 to 8 bytes each cross the
/// bus), or, when that would send more than the mask itself, the whole mask
/// written into `scratch` and copied over. (It runs on any device: the tests
/// run it on the CPU.)
fn write_on_device<T: MaskValue>(
    flat: &Tensor,
    old: &Plan,
    new: &Plan,
    scratch: &mut Vec<T>,
) -> candle_core::Result<Sent> {
    let mut changed = 0;
    mask::changes(old, new, |run, _| changed += run.len());
    if changed == 0 {
        return Ok(Sent::Nothing);
    }
    let len = new.len();
    let pair = 4 + std::mem::size_of::<T>();
    if changed * pair >= len * std::mem::size_of::<T>() || u32::try_from(len).is_err() {
        scratch.clear();
        scratch.resize(len, T::MASKED);
        mask::write(&Plan::default(), new, scratch);
        let whole = Tensor::from_slice(scratch, len, flat.device())?;
        flat.slice_set(&whole, 0, 0)?;
        return Ok(Sent::Whole);
    }
    let mut indices = Vec::with_capacity(changed);
    scratch.clear();
    mask::changes(old, new, |run, visible| {
        let value = if visible { T::VISIBLE } else { T::MASKED };
        scratch.extend(std::iter::repeat_n(value, run.len()));
        indices.extend(run.map(|i| i as u32));
    });
    let indices = Tensor::from_vec(indices, changed, flat.device())?;
    let values = Tensor::from_slice(scratch, changed, flat.device())?;
    flat.scatter_set(&indices, &values, 0)?;
    Ok(Sent::Changes(changed))
}

/// Writes a planned mask over a CPU tensor that holds `old`.
struct WriteMask<'a> {
    old: &'a Plan,
    new: &'a Plan,
}

impl candle_core::InplaceOp1 for WriteMask<'_> {
    fn name(&self) -> &'static str {
        "kvcache-write-mask"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("mask buffer view is not contiguous".into()))?;
        match storage {
            CpuStorage::F32(data) => mask::write(self.old, self.new, &mut data[start..end]),
            CpuStorage::F16(data) => mask::write(self.old, self.new, &mut data[start..end]),
            CpuStorage::BF16(data) => mask::write(self.old, self.new, &mut data[start..end]),
            _ => return Err(candle_core::Error::Msg("mask buffer of a non-mask dtype".into())),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use kvcache_api::RowRuns;
    use proptest::prelude::*;

    use super::*;

    /// The plan of a mask whose row `r` sees the cells where `rows[r]` is true.
    fn planned(rows: &[Vec<bool>]) -> Plan {
        let width = rows.first().map_or(0, Vec::len);
        let mut runs = RowRuns::default();
        for row in rows {
            let mut spans: Vec<std::ops::Range<u32>> = Vec::new();
            for (cell, &seen) in row.iter().enumerate() {
                let cell = cell as u32;
                match spans.last_mut() {
                    Some(last) if seen && last.end == cell => last.end = cell + 1,
                    _ if seen => spans.push(cell..cell + 1),
                    _ => {}
                }
            }
            runs.push_row(spans);
        }
        let mut plan = Plan::default();
        mask::plan(&runs, rows.len(), 0..width, &mut plan);
        plan
    }

    /// The mask `plan` describes, written in full.
    fn dense(plan: &Plan) -> Vec<f32> {
        let mut out = vec![0.0; plan.len()];
        mask::write(&Plan::default(), plan, &mut out);
        out
    }

    /// Writes `masks` one after another into one kept flat buffer of `room`
    /// entries through the device path (run on the CPU), checking the buffer
    /// after each against the masks written in full; returns what each sent.
    fn replay(masks: &[Plan], room: usize) -> Vec<Sent> {
        let flat = Tensor::zeros(room, CandleDType::F32, &Device::Cpu).unwrap();
        let (mut held, mut scratch, mut sent) = (Plan::all_visible(room), Vec::new(), Vec::new());
        for mask in masks {
            let mut next = mask.clone();
            sent.push(write_on_device::<f32>(&flat, &held, &next, &mut scratch).unwrap());
            next.keep_tail_of(&held);
            held = next;
            let got = flat.to_vec1::<f32>().unwrap();
            assert_eq!(&got[..mask.len()], &dense(mask)[..]);
            assert_eq!(got, dense(&held), "the tail past the mask is what the plan says");
        }
        sent
    }

    #[test]
    fn decode_steps_send_their_changes_and_a_repeated_pass_nothing() {
        // Four sequences of 8 cells each, one row each, decoding: each step a
        // new cell per sequence at the end of the range.
        let step = |n: usize| -> Plan {
            let width = 32 + 4 * n;
            let rows: Vec<Vec<bool>> = (0..4)
                .map(|s| {
                    (0..width)
                        .map(|c| c / 8 == s || (c >= 32 && (c - 32) % 4 == s))
                        .collect()
                })
                .collect();
            planned(&rows)
        };
        let masks: Vec<Plan> = (0..6).map(step).chain([step(5)]).collect();
        let sent = replay(&masks, 4 * 64);
        assert_eq!(sent[0], Sent::Whole, "a fresh buffer is mostly masked entries");
        for s in &sent[1..6] {
            // The rows' stride grows by 4: a few entries per row change, not the mask.
            assert!(matches!(s, Sent::Changes(n) if *n < 4 * 36 / 2), "{sent:?}");
        }
        assert_eq!(sent[6], Sent::Nothing);
    }

    fn any_rows() -> impl Strategy<Value = Vec<Vec<bool>>> {
        (1usize..5, 1usize..24).prop_flat_map(|(rows, width)| {
            prop::collection::vec(prop::collection::vec(any::<bool>(), width), rows)
        })
    }

    proptest! {
        /// Whatever the sequence of masks, the kept device buffer holds each
        /// exactly after its write, whichever way it was sent.
        #[test]
        fn the_device_path_holds_every_mask(
            masks in prop::collection::vec(any_rows(), 1..8),
            edits in prop::collection::vec((0usize..5, 0usize..24), 0..8),
        ) {
            let mut plans: Vec<Plan> = masks.iter().map(|rows| planned(rows)).collect();
            // Small edits of the last mask too, so that changes are scattered.
            let mut rows = masks.last().unwrap().clone();
            for (r, c) in edits {
                let (r, c) = (r % rows.len(), c % rows[0].len());
                rows[r][c] = !rows[r][c];
                plans.push(planned(&rows));
            }
            replay(&plans, 5 * 24);
        }
    }
}
