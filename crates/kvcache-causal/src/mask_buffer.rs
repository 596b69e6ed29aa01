//! The tensor a pass's mask lives in, reused from pass to pass.
//!
//! A prefill mask is megabytes (512 queries over 8,704 cells is 17.8 MB in f32).
//! Allocating it afresh every pass costs more than writing it: each new page
//! faults and is zeroed by the kernel, and the fresh buffer is cold in cache. So on
//! the CPU the mask is written in place into a flat tensor kept between passes, and
//! the pass's mask is a `[rows, cols]` view of its prefix; the buffer grows (by
//! doubling) to hold the largest mask seen and stays there. On other devices the
//! mask is written into a kept host vector and uploaded, one fresh device tensor
//! per pass.
//!
//! Writing in place is why `get`'s mask, like its keys and values, is a view that
//! stays valid only until the next `start_forward`: a caller that keeps a mask
//! across passes must copy it.
//!
//! The buffer's content is known (the [`Plan`] last written into it), so each pass
//! writes only the entries that change (see [`crate::mask`]); a buffer freshly
//! allocated is zeroed, that is all visible, and gets only its masked entries.
//!
//! Worst-case (reserve) masks span every cell and are built once when an engine
//! sizes its graphs; unless the kept buffer already fits them they get a buffer of
//! their own, dropped with the pass, so the kept buffer is sized by real passes.

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{CpuStorage, Device, Layout, Tensor};
use half::{bf16, f16};
use kvcache_api::{CacheError, DType, ForwardMode, Result};

use crate::book::Book;
use crate::mask::{self, MaskValue, Plan};
use crate::storage::{candle_dtype, same_storage};

/// Kept buffers for the masks of successive passes.
#[derive(Debug, Default)]
pub(crate) struct MaskBuffer {
    /// CPU: a flat tensor whose prefix holds the current mask.
    tensor: Option<Tensor>,
    /// Other devices: the host copy written before each upload.
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

/// Host vectors, one per mask dtype; only the configured dtype's is ever filled.
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
        let mask = match device {
            Device::Cpu => self.write_in_place(dtype, reserve, largest),
            _ => self.upload(dtype, device),
        };
        mask.and_then(|flat| flat.reshape(shape))
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
            self.write_in_place(dtype, false, 0)
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

    /// Writes the planned mask into the kept tensor, or into a new one when it does
    /// not fit (kept unless `reserve`); returns the flat mask.
    ///
    /// A new kept tensor has room for twice the old one's entries (up to `largest`,
    /// the most a mask of the cache can have), so masks that grow pass after pass
    /// (a prefill in chunks, decoding into more cells) get a new buffer a few
    /// times, not every pass. The room past the mask is written masked at once, so
    /// it is known (only differences are written into it later) and its pages are
    /// touched when the buffer is made rather than pass after pass.
    fn write_in_place(&mut self, dtype: DType, reserve: bool, largest: usize) -> candle_core::Result<Tensor> {
        if std::mem::take(self.shared.get_mut()) {
            self.tensor = None;
            self.held = Plan::default();
        }
        let len = self.next.len();
        let dtype = candle_dtype(dtype);
        let fits = |t: &&Tensor| t.dtype() == dtype && t.elem_count() >= len;
        if let Some(kept) = self.tensor.as_ref().filter(fits) {
            let mask = kept.narrow(0, 0, len)?;
            mask.inplace_op1(&WriteMask {
                old: &self.held,
                new: &self.next,
            })?;
            self.next.keep_tail_of(&self.held);
            std::mem::swap(&mut self.held, &mut self.next);
            return Ok(mask);
        }
        let kept = self.tensor.as_ref().filter(|t| t.dtype() == dtype);
        let room = match kept {
            Some(kept) if !reserve => len.max((2 * kept.elem_count()).min(largest)),
            _ => len,
        };
        // Entries past the mask are written masked now, so that later, larger masks
        // find them known and in memory already touched.
        self.next.extend_masked(room);
        let fresh = Tensor::zeros(room, dtype, &Device::Cpu)?;
        fresh.inplace_op1(&WriteMask {
            old: &Plan::all_visible(room),
            new: &self.next,
        })?;
        if !reserve {
            self.tensor = Some(fresh.clone());
            std::mem::swap(&mut self.held, &mut self.next);
        }
        fresh.narrow(0, 0, len)
    }

    fn upload(&mut self, dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
        let (held, next) = (&self.held, &self.next);
        let mask = match dtype {
            DType::F32 => upload_from(&mut self.host.f32, held, next, device),
            DType::F16 => upload_from(&mut self.host.f16, held, next, device),
            DType::BF16 => upload_from(&mut self.host.bf16, held, next, device),
        };
        std::mem::swap(&mut self.held, &mut self.next);
        mask
    }
}

fn upload_from<T: MaskValue>(
    host: &mut Vec<T>,
    held: &Plan,
    next: &Plan,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let len = next.len();
    if host.len() < len {
        host.resize(len, T::MASKED);
    }
    mask::write(held, next, &mut host[..len]);
    Tensor::from_slice(&host[..len], len, device)
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
