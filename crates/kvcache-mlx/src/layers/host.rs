//! Paging copies done on the host with `memcpy` (Linux, where mlx arrays live
//! in host memory), for the cache's own row-contiguous arrays.
//!
//! mlx's CPU copy loop moves one element per step with runtime strides, and
//! on the P3 workload runs at about 45% of a plain `memcpy` of the same bytes;
//! copying each head's run of rows with `memcpy` is what the hardware allows.
//! Two things are done here:
//!
//! - [`write_rows`] writes rows into a cache buffer in place. mlx arrays are
//!   immutable to everyone else, so the buffer is first made exclusive the way
//!   mlx itself decides it may write in place: a one-row `slice_update`,
//!   evaluated, either takes over the buffer (mlx donates it only when no other
//!   array shares it) or copies it into a new one. Then nothing else can see
//!   the buffer, and the remaining rows are copied with `memcpy`.
//! - [`whole_copy`] copies a compact array into a new one with a single
//!   `memcpy` (mlx's `array(data, shape)` constructor).
//! - [`compact_rows`] copies runs of rows of several arrays (a snapshot's
//!   range of the live buffer, a split's halves, a merge's two snapshots) into
//!   new compact arrays, writing each byte once: mlx allocates the output of a
//!   `load` from our reader, and the reader copies the rows into it.
//!
//! Everything else (strided sources, callers' arrays, other platforms) goes
//! through mlx ops, which is always correct.

use std::ffi::{c_char, c_int, c_void};
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kvcache_api::Result;
use mlx_rs::ops::indexing::TryIndexMutOp;
use mlx_rs::Array;

use super::arrays::{backend, dim, seq_len, seq_slice};

/// The data pointer and length in bytes of `a`, when `a` is evaluated and
/// row-contiguous (a compact array or a whole buffer, not a strided view) and
/// not empty; `None` otherwise.
///
/// The pointer comes straight from mlx (not through a reference), so a caller
/// that owns the buffer exclusively may write through it.
fn host_data(a: &Array) -> Result<Option<(*mut u8, usize)>> {
    a.eval().map_err(backend)?;
    let mut row_contiguous = false;
    // SAFETY: `a` is a valid, evaluated array handle for the duration of the call,
    // and `row_contiguous` outlives it.
    let rc = unsafe { mlx_sys::_mlx_array_is_row_contiguous(&mut row_contiguous, a.as_ptr()) };
    if rc != 0 || !row_contiguous || a.nbytes() == 0 {
        return Ok(None);
    }
    // SAFETY: `a` is a valid, evaluated array handle; the call only reads it.
    let data = unsafe { mlx_sys::mlx_array_data_uint8(a.as_ptr()) };
    if data.is_null() {
        return Ok(None);
    }
    Ok(Some((data.cast_mut(), a.nbytes())))
}

/// The data of `a` as bytes, when `a` is evaluated and row-contiguous (see
/// [`host_data`]); `None` otherwise.
fn host_bytes(a: &Array) -> Result<Option<&[u8]>> {
    let Some((data, len)) = host_data(a)? else {
        return Ok(None);
    };
    // SAFETY: an evaluated row-contiguous array's data is `nbytes` contiguous,
    // initialised bytes starting at its data pointer (`data<uint8_t>()` is that
    // pointer whatever the dtype). The slice borrows `a`, which holds the
    // buffer, so the buffer outlives it; and nothing writes the buffer while
    // `a` holds it: mlx writes an evaluated buffer only when it donates it to
    // an op, which it does only when no other array (`a` here) shares it, and
    // `write_rows` writes only into a buffer made exclusive to its `&mut Array`.
    Ok(Some(unsafe { std::slice::from_raw_parts(data, len) }))
}

/// The row geometry shared by two `[B, H, *, D]` arrays: `(B * H, bytes per
/// position)`, or `None` when their batch, heads, head dim or item size differ.
fn geometry(a: &Array, b: &Array) -> Option<(usize, usize)> {
    let (sa, sb) = (a.shape(), b.shape());
    let same = a.ndim() == 4
        && b.ndim() == 4
        && a.dtype() == b.dtype()
        && sa[0] == sb[0]
        && sa[1] == sb[1]
        && sa[3] == sb[3];
    same.then(|| (sa[0] as usize * sa[1] as usize, sa[3] as usize * a.item_size()))
}

/// Copies of at least this many bytes in all use non-temporal stores: the
/// rows written are more than a core's cache would keep anyway, and writing
/// them around the cache spares reading every destination line first (what a
/// large `memcpy`, the baseline of P3, does too).
const STREAM_MIN_BYTES: usize = 1 << 20;

/// Copies positions `src_rows` of every head of `src` to positions starting at
/// `dst_start` of the same head of `dst`; both are `[B, H, L, D]` row-major
/// bytes with `heads = B * H` and `row` bytes per position.
fn copy_rows(dst: &mut [u8], src: &[u8], heads: usize, row: usize, src_rows: Range<usize>, dst_start: usize) {
    let src_len = src.len() / (heads * row);
    let dst_len = dst.len() / (heads * row);
    let n = src_rows.len() * row;
    let stream = n * heads >= STREAM_MIN_BYTES;
    for h in 0..heads {
        let s = (h * src_len + src_rows.start) * row;
        let d = (h * dst_len + dst_start) * row;
        copy_bytes(&mut dst[d..d + n], &src[s..s + n], stream);
    }
}

/// `dst.copy_from_slice(src)`, with non-temporal stores when `stream` is set
/// and the target has them (x86-64: SSE2, part of its baseline).
fn copy_bytes(dst: &mut [u8], src: &[u8], stream: bool) {
    #[cfg(target_arch = "x86_64")]
    if stream {
        stream_copy(dst, src);
        return;
    }
    let _ = stream;
    dst.copy_from_slice(src);
}

/// `dst.copy_from_slice(src)` writing 64-byte blocks with `movntdq`.
#[cfg(target_arch = "x86_64")]
fn stream_copy(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    assert_eq!(dst.len(), src.len(), "copy between slices of different lengths");
    // Plain copies up to the first 16-byte aligned destination byte and after
    // the last whole block.
    let head = dst.as_ptr().align_offset(16).min(dst.len());
    let body = (dst.len() - head) / 64 * 64;
    let (dst_head, rest) = dst.split_at_mut(head);
    let (dst_body, dst_tail) = rest.split_at_mut(body);
    let (src_head, rest) = src.split_at(head);
    let (src_body, src_tail) = rest.split_at(body);
    dst_head.copy_from_slice(src_head);
    for (d, s) in dst_body.chunks_exact_mut(64).zip(src_body.chunks_exact(64)) {
        for i in 0..4 {
            // SAFETY: `s[16 * i..]` holds 16 readable bytes (an unaligned load is
            // allowed); `d[16 * i..]` holds 16 writable bytes at a 16-byte
            // aligned address (`d` starts at an aligned address and advances in
            // 64-byte steps), which `_mm_stream_si128` requires; SSE2 is enabled
            // on every x86-64 target. `d` and `s` are distinct slices, so they do
            // not overlap.
            unsafe {
                let v = _mm_loadu_si128(s.as_ptr().add(16 * i).cast::<__m128i>());
                _mm_stream_si128(d.as_mut_ptr().add(16 * i).cast::<__m128i>(), v);
            }
        }
    }
    dst_tail.copy_from_slice(src_tail);
    // Non-temporal stores are weakly ordered: fence them before anything else
    // (mlx's stream thread) may read the buffer.
    // SAFETY: `sfence` has no preconditions beyond SSE, enabled on x86-64.
    unsafe { _mm_sfence() };
}

/// Writes positions `rows` of `update` at `[start, start + rows.len())` of
/// `buf`, both evaluated-able `[B, H, *, D]` arrays of one dtype, in place when
/// possible. Returns `false` when the host path does not apply (a strided
/// `update`, other shapes or dtypes, positions out of range), for the caller to
/// write every row with mlx ops instead; `buf` then holds the same values as
/// before, or already has the first row written (which the caller rewrites).
pub(crate) fn write_rows(buf: &mut Array, start: usize, update: &Array, rows: Range<usize>) -> Result<bool> {
    let Some((heads, row)) = geometry(buf, update) else {
        return Ok(false);
    };
    let end = start + rows.len();
    if rows.is_empty() || rows.end > seq_len(update) || end > seq_len(buf) {
        return Ok(false);
    }
    let Some(src) = host_bytes(update)? else {
        return Ok(false);
    };
    // Make `buf` the sole owner of its data (see the module docs), writing the
    // first row on the way.
    // `try_index_mut` replaces `buf` with the `slice_update`, dropping our handle
    // to the old array, so only the pending op refers to it when it runs.
    let first = seq_slice(update, rows.start, rows.start + 1)?;
    buf.try_index_mut((.., .., dim(start)?..dim(start + 1)?, ..), &first)
        .map_err(backend)?;
    buf.eval().map_err(backend)?;
    if rows.len() == 1 {
        // Done, and nothing may be written here anyway: when `buf` is a single
        // row (a cache growing in steps of 1), the update covers all of it and
        // mlx's `slice_update` returns the update itself, so `buf` now shares
        // the buffer of `update` (a snapshot being restored) instead of owning
        // one of its own.
        return Ok(true);
    }
    let Some((ptr, len)) = host_data(buf)? else {
        // A slice_update of a whole buffer is row-contiguous; should mlx ever
        // answer otherwise, the caller rewrites every row through mlx.
        return Ok(false);
    };
    // With two rows or more, `buf` (at least that long) is larger than the
    // one-row update, so the `slice_update` was a real one and cannot have
    // returned `update`. Should an mlx version share `update`'s buffer anyway,
    // leave the rest to mlx rather than write into it.
    let src_range = src.as_ptr() as usize..src.as_ptr() as usize + src.len();
    if (ptr as usize) < src_range.end && src_range.start < ptr as usize + len {
        return Ok(false);
    }
    // SAFETY: `ptr` and `len` are `buf`'s data pointer and byte length, taken
    // from mlx (not derived from a shared reference), after `buf` was produced
    // by an evaluated `slice_update` that is not the whole-update shortcut
    // (above) and whose input handle we dropped before evaluation: its buffer
    // was either donated by mlx (which it does only when no other array shares
    // the buffer) or newly allocated for it. No view of `buf` has been made
    // since, and `buf` is borrowed mutably here, so no other array, graph node
    // or slice can read or write these bytes while the copy runs; `buf` keeps
    // them alive. `src` is `update`'s buffer, checked just above not to overlap
    // them.
    let dst = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
    copy_rows(dst, src, heads, row, rows.start + 1..rows.end, start + 1);
    Ok(true)
}

/// An evaluated copy of all of `a` in a new buffer, made by one `memcpy`, when
/// `a` is evaluated-able and row-contiguous; `None` otherwise.
pub(crate) fn whole_copy(a: &Array) -> Result<Option<Array>> {
    if host_bytes(a)?.is_none() {
        return Ok(None);
    }
    // `deep_clone` copies an evaluated row-contiguous array's bytes into a new
    // array with mlx's `array(data, shape)` constructor.
    let copy = a.deep_clone();
    copy.eval().map_err(backend)?;
    Ok(Some(copy))
}

/// One output of [`compact_rows`]: positions `rows` of each part, in order,
/// joined along the sequence axis.
pub(crate) type RowParts<'a> = &'a [(&'a Array, Range<usize>)];

/// Evaluated copies, each in a new buffer of exactly its `nbytes()`, of the
/// `[B, H, n, D]` arrays that join positions `rows` of each part's `(array,
/// rows)` along the sequence axis (`n` the sum of the row counts), with one
/// `memcpy`-class pass over the bytes and no other write: `None`, having made
/// nothing, when the host path does not apply (strided or mismatched parts, no
/// rows), for the caller to use mlx ops instead.
///
/// mlx has no way to hand out an uninitialised buffer, and its CPU allocator
/// cannot adopt ours, but its `load` from a custom reader allocates the output
/// and asks the reader to fill it: each output is "loaded" from a reader that
/// serves an `.npy` header for `[B, H, n, D * item]` bytes and copies each
/// head's runs of rows straight into mlx's buffer. The copy is then a view of
/// those bytes as the parts' dtype. All outputs are evaluated together, and the
/// readers' plans are closed before returning, on every path (an error, a
/// panic): a late read then fails rather than touch the parts or a buffer mlx
/// has freed.
pub(crate) fn compact_rows(outputs: &[RowParts<'_>]) -> Result<Option<Vec<Array>>> {
    let mut plans = Vec::with_capacity(outputs.len());
    for parts in outputs {
        let Some(plan) = plan_rows(parts)? else {
            return Ok(None);
        };
        plans.push(plan);
    }
    let mut loaded = Vec::with_capacity(plans.len());
    // Declared after `loaded`, so that on an early return or a panic it closes
    // the plans before the loaded arrays (whose buffers the reads write) go.
    let mut open = OpenPlans(Vec::with_capacity(plans.len()));
    for (plan, parts) in plans.into_iter().zip(outputs) {
        let (first, _) = parts[0];
        let shape = first.shape();
        let dims = [shape[0] as usize, shape[1] as usize, plan.rows, plan.row];
        let state = Arc::new(Mutex::new(Some(plan)));
        open.0.push(Arc::clone(&state));
        // SAFETY: `open` closes the plan before this function returns or
        // unwinds, so before the parts (borrowed by `outputs` for longer)
        // change or go. Evaluation starts only once every output is in
        // `loaded`, which `open` is dropped before (declared after it); an
        // error out of this loop drops `bytes` or earlier outputs unevaluated,
        // when mlx has nothing left to read for them (it reads the header
        // within `load`, the data only when evaluating).
        let bytes = unsafe { load_bytes(dims, state) }?;
        let copy = if first.dtype() == mlx_rs::Dtype::Uint8 {
            bytes
        } else {
            bytes.view_dtype(first.dtype()).map_err(backend)?
        };
        loaded.push(copy);
    }
    let evaluated = super::arrays::eval(&loaded);
    drop(open);
    evaluated?;
    Ok(Some(loaded))
}

/// The plans of [`compact_rows`]'s readers, closed when this is dropped, which
/// happens on every way out of `compact_rows`, unwinding included: reads that
/// mlx makes after that (a late one on its io pool, after an evaluation
/// failed) find the plan closed and copy nothing.
struct OpenPlans(Vec<Arc<Mutex<Option<RowPlan>>>>);

impl Drop for OpenPlans {
    fn drop(&mut self) {
        for plan in &self.0 {
            // Taking the lock waits for a read in progress to finish.
            *plan.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }
}

/// The copy plan for one output of [`compact_rows`], or `None` when its parts
/// are not all evaluated row-contiguous `[B, H, *, D]` arrays of one geometry.
fn plan_rows(parts: RowParts<'_>) -> Result<Option<RowPlan>> {
    let Some(&(first, _)) = parts.first() else {
        return Ok(None);
    };
    let mut runs = Vec::with_capacity(parts.len());
    let mut geom = None;
    for (a, rows) in parts {
        let Some(g) = geometry(first, a) else {
            return Ok(None);
        };
        if rows.end > seq_len(a) || rows.start > rows.end {
            return Ok(None);
        }
        // The raw pointer straight from mlx: the plan outlives any borrow.
        let Some((data, _)) = host_data(a)? else {
            return Ok(None);
        };
        geom = Some(g);
        runs.push(SourceRun {
            data: data.cast_const(),
            len: seq_len(a),
            rows: rows.clone(),
        });
    }
    let (heads, row) = geom.expect("at least one part");
    let rows: usize = runs.iter().map(|r| r.rows.len()).sum();
    if rows == 0 {
        return Ok(None);
    }
    Ok(Some(RowPlan {
        heads,
        row,
        rows,
        runs,
    }))
}

/// Positions `rows` of a `[B, H, len, D]` row-major buffer at `data`.
struct SourceRun {
    data: *const u8,
    len: usize,
    rows: Range<usize>,
}

/// What one reader of [`compact_rows`] copies: for each of `heads` heads, the
/// runs in order, `row` bytes per position, `rows` positions in all.
struct RowPlan {
    heads: usize,
    row: usize,
    rows: usize,
    runs: Vec<SourceRun>,
}

// SAFETY: a plan holds raw pointers into the parts' buffers and nothing else
// that is tied to a thread; it is moved into the `Mutex` its reader shares, and
// its pointers are followed only by `copy_to`, whose callers hold that mutex
// and see the plan open (see `copy_to`'s contract).
unsafe impl Send for RowPlan {}

impl RowPlan {
    fn payload(&self) -> usize {
        self.heads * self.rows * self.row
    }

    /// Copies payload bytes `[at, at + dst.len())` into `dst`.
    ///
    /// # Safety
    /// The arrays the plan was made from (by [`plan_rows`]) must still be
    /// alive and unchanged: the plan is open, which [`compact_rows`] ensures
    /// for as long as it borrows them and no longer.
    unsafe fn copy_to(&self, dst: &mut [u8], at: usize) {
        let stream = dst.len() >= STREAM_MIN_BYTES;
        let end = at + dst.len();
        let mut pos = 0;
        for h in 0..self.heads {
            for run in &self.runs {
                let n = run.rows.len() * self.row;
                let (lo, hi) = (pos.max(at), (pos + n).min(end));
                if lo < hi {
                    let s = (h * run.len + run.rows.start) * self.row + (lo - pos);
                    // SAFETY: the run lies inside its source's `heads * len * row`
                    // bytes (`rows.end <= len`, checked in `plan_rows`, and
                    // `lo - pos < n`), which are alive and unchanged (this
                    // function's contract), and evaluated mlx buffers are
                    // initialised.
                    let src = unsafe { std::slice::from_raw_parts(run.data.add(s), hi - lo) };
                    copy_bytes(&mut dst[lo - at..hi - at], src, stream);
                }
                pos += n;
            }
        }
    }
}

/// The descriptor behind an mlx `io::Reader`: a `.npy` header, then the bytes
/// the plan copies; `plan` is `None` once closed. Every callback takes shared
/// access only (the position is atomic), so callbacks that mlx might make at
/// the same time from different threads never alias a `&mut`.
struct Reader {
    header: Vec<u8>,
    pos: AtomicUsize,
    plan: Arc<Mutex<Option<RowPlan>>>,
    payload: usize,
}

/// An `.npy` (version 1.0) header for row-major `u8` data of shape `dims`.
fn npy_header(dims: [usize; 4]) -> Vec<u8> {
    let [b, h, n, d] = dims;
    let mut dict = format!("{{'descr': '|u1', 'fortran_order': False, 'shape': ({b}, {h}, {n}, {d}), }}");
    // Pad with spaces to a 64-byte multiple, newline last, as numpy does.
    while (10 + dict.len() + 1) % 64 != 0 {
        dict.push(' ');
    }
    dict.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out
}

/// A lazy `u8` array `[B, H, n, D * item]` loaded through a reader of `plan`.
///
/// # Safety
/// Until `plan` is closed (set to `None` under its lock), mlx may read through
/// the reader at any time, even after an evaluation of the array failed or
/// panicked (a late read on mlx's io pool): it copies from the arrays the plan
/// points into, into the buffer mlx allocated for the returned array. So the
/// caller must close `plan` before those arrays change or are dropped, and
/// before it drops the returned array or anything computed from it once their
/// evaluation has started; [`compact_rows`] does both with [`OpenPlans`].
unsafe fn load_bytes(dims: [usize; 4], plan: Arc<Mutex<Option<RowPlan>>>) -> Result<Array> {
    let payload = plan
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .map_or(0, RowPlan::payload);
    let reader = Box::new(Reader {
        header: npy_header(dims),
        pos: AtomicUsize::new(0),
        plan,
        payload,
    });
    let vtable = mlx_sys::mlx_io_vtable {
        is_open: Some(reader_true),
        good: Some(reader_true),
        tell: Some(reader_tell),
        seek: Some(reader_seek),
        read: Some(reader_read),
        read_at_offset: Some(reader_read_at),
        write: Some(reader_write),
        label: Some(reader_label),
        free: Some(reader_free),
    };
    // SAFETY: `desc` is a leaked `Box<Reader>`, which mlx frees exactly once
    // through `reader_free` when its last reference to the reader goes (our
    // handle below, the parsing in `load`, the `Load` primitive); until then
    // every callback gets that live `Reader` (the contract of the `reader_*`
    // functions), and its reads copy only while the plan is open, which this
    // function's caller keeps sound. The stream handle is freed after use and
    // `res` is a fresh array handle that `Array::from_ptr` takes over.
    unsafe {
        let io = mlx_sys::mlx_io_reader_new(Box::into_raw(reader).cast(), vtable);
        let stream = mlx_sys::mlx_default_cpu_stream_new();
        let mut res = mlx_sys::mlx_array_new();
        let rc = mlx_sys::mlx_load_reader(&mut res, io, stream);
        mlx_sys::mlx_io_reader_free(io);
        mlx_sys::mlx_stream_free(stream);
        let array = Array::from_ptr(res);
        if rc != 0 {
            return Err(backend("mlx could not load from the row reader"));
        }
        Ok(array)
    }
}

/// The `Reader` behind an mlx reader descriptor.
///
/// # Safety
/// `desc` must be the pointer `load_bytes` gave mlx, not yet freed, and not
/// freed while the returned reference is in use (mlx frees it once, after its
/// last call).
unsafe fn reader<'a>(desc: *mut c_void) -> &'a Reader {
    // SAFETY: see the function's contract; only shared references to the
    // `Reader` are ever made while it lives.
    unsafe { &*desc.cast::<Reader>() }
}

/// The reader's `is_open` and `good`: always.
extern "C" fn reader_true(_: *mut c_void) -> bool {
    true
}

/// The reader's `tell`.
///
/// # Safety
/// `desc` must be a live reader descriptor (see [`reader`]).
unsafe extern "C" fn reader_tell(desc: *mut c_void) -> usize {
    // SAFETY: the function's contract.
    unsafe { reader(desc) }.pos.load(Ordering::Relaxed)
}

/// The reader's `seek`.
///
/// # Safety
/// `desc` must be a live reader descriptor (see [`reader`]).
unsafe extern "C" fn reader_seek(desc: *mut c_void, off: i64, whence: c_int) -> c_int {
    // SAFETY: the function's contract.
    let r = unsafe { reader(desc) };
    let base = match whence {
        libc_seek::SET => 0,
        libc_seek::CUR => r.pos.load(Ordering::Relaxed) as i64,
        libc_seek::END => (r.header.len() + r.payload) as i64,
        _ => return -1,
    };
    match usize::try_from(base + off) {
        Ok(pos) => {
            r.pos.store(pos, Ordering::Relaxed);
            0
        }
        Err(_) => -1,
    }
}

/// `SEEK_*` values (the same on every Linux target).
mod libc_seek {
    pub(super) const SET: i32 = 0;
    pub(super) const CUR: i32 = 1;
    pub(super) const END: i32 = 2;
}

/// The reader's `read`: at the current position, which it advances.
///
/// # Safety
/// `desc` must be a live reader descriptor (see [`reader`]), and `data` as
/// [`read_at`] requires.
unsafe extern "C" fn reader_read(desc: *mut c_void, data: *mut c_char, n: usize) -> usize {
    // SAFETY: the function's contract.
    let r = unsafe { reader(desc) };
    let at = r.pos.load(Ordering::Relaxed);
    // SAFETY: the function's contract.
    let read = unsafe { read_at(r, data, n, at) };
    r.pos.store(at + read, Ordering::Relaxed);
    read
}

/// The reader's `read_at_offset`; the position is left alone.
///
/// # Safety
/// `desc` must be a live reader descriptor (see [`reader`]), and `data` as
/// [`read_at`] requires.
unsafe extern "C" fn reader_read_at(desc: *mut c_void, data: *mut c_char, n: usize, off: usize) -> usize {
    // SAFETY: the function's contract.
    unsafe { read_at(reader(desc), data, n, off) }
}

/// Reads up to `n` bytes at `off` of the header-then-payload stream into
/// `data`; returns how many, 0 once the plan is closed (which mlx's reader
/// turns into an error), having then not touched `data` at all.
///
/// # Safety
/// While `r`'s plan is open, `data` must be valid for writes of `n` bytes
/// that nothing else reads or writes during the call (mlx's header scratch
/// buffer, or the `Load` output, allocated for that array alone and not yet
/// visible to anyone), and the plan's sources alive (see
/// [`RowPlan::copy_to`]). Once the plan is closed `data` may dangle.
unsafe fn read_at(r: &Reader, data: *mut c_char, n: usize, off: usize) -> usize {
    let total = r.header.len() + r.payload;
    let n = n.min(total.saturating_sub(off));
    if n == 0 {
        return 0;
    }
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // The lock is held for the whole copy, so closing the plan waits for a
        // read in progress, and a read that starts later finds it closed.
        let guard = r.plan.lock().unwrap_or_else(|e| e.into_inner());
        let Some(plan) = guard.as_ref() else {
            // Closed: `data` may point into a buffer mlx has freed; make no
            // reference to it.
            return 0;
        };
        // SAFETY: the plan is open, so by the function's contract `data` holds
        // `n` writable bytes that nothing else uses during the call.
        let dst = unsafe { std::slice::from_raw_parts_mut(data.cast::<u8>(), n) };
        let header = r.header.len();
        let split = header.saturating_sub(off).min(n);
        dst[..split].copy_from_slice(&r.header[off.min(header)..off.min(header) + split]);
        if split < n {
            // SAFETY: the plan is open, and its sources alive (the function's
            // contract).
            unsafe { plan.copy_to(&mut dst[split..], off + split - header) };
        }
        n
    }));
    result.unwrap_or(0)
}

/// The reader's `write`: refused.
extern "C" fn reader_write(_: *mut c_void, _: *const c_char, _: usize) -> usize {
    0
}

/// The reader's `label`.
extern "C" fn reader_label(_: *mut c_void) -> *const c_char {
    c"kvcache-mlx row copy".as_ptr()
}

/// The reader's `free`.
///
/// # Safety
/// `desc` must be a reader descriptor from [`load_bytes`], freed no other way
/// and used by no call after this one (mlx calls `free` once, when its last
/// reference to the reader goes).
unsafe extern "C" fn reader_free(desc: *mut c_void) {
    // SAFETY: the function's contract: `desc` came from `Box::into_raw` in
    // `load_bytes` and nothing uses it any more.
    drop(unsafe { Box::from_raw(desc.cast::<Reader>()) });
}
#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::Dtype;

    fn iota(shape: &[i32], offset: f32) -> Array {
        let n: i32 = shape.iter().product();
        let a = Array::from_slice(&(0..n).map(|i| i as f32 + offset).collect::<Vec<_>>(), shape);
        a.eval().unwrap();
        a
    }

    fn values(a: &Array) -> Vec<f32> {
        let c = a.contiguous().unwrap();
        c.eval().unwrap();
        c.as_slice::<f32>().to_vec()
    }

    fn address(a: &Array) -> usize {
        a.as_slice::<f32>().as_ptr() as usize
    }

    /// What `write_rows` must produce, computed with mlx ops.
    fn expected(buf: &Array, start: usize, update: &Array, rows: Range<usize>) -> Vec<f32> {
        let mut out = buf.clone();
        let end = start + rows.len();
        let src = seq_slice(update, rows.start, rows.end).unwrap();
        out.try_index_mut((.., .., start as i32..end as i32, ..), &src)
            .unwrap();
        values(&out)
    }

    #[test]
    fn rows_are_written_in_place_into_an_unshared_buffer() {
        let update = iota(&[2, 3, 5, 4], 1000.0);
        let mut buf = iota(&[2, 3, 16, 4], 0.0);
        let want = expected(&buf, 6, &update, 1..4);
        let before = address(&buf);
        assert!(write_rows(&mut buf, 6, &update, 1..4).unwrap());
        assert_eq!(address(&buf), before, "an unshared buffer is written in place");
        assert_eq!(values(&buf), want);
        assert_eq!(buf.shape(), &[2, 3, 16, 4]);
    }

    #[test]
    fn a_shared_buffer_is_copied_and_its_views_keep_their_values() {
        let update = iota(&[1, 2, 8, 4], 1000.0);
        let mut buf = iota(&[1, 2, 16, 4], 0.0);
        let view = seq_slice(&buf, 0, 12).unwrap();
        view.eval().unwrap();
        let other = buf.clone();
        let (view_before, other_before) = (values(&view), values(&other));
        let want = expected(&buf, 4, &update, 0..8);
        assert!(write_rows(&mut buf, 4, &update, 0..8).unwrap());
        assert_eq!(values(&buf), want);
        assert_eq!(
            values(&view),
            view_before,
            "a view taken before the write sees old data"
        );
        assert_eq!(values(&other), other_before);
        assert_ne!(address(&buf), address(&other));
    }

    #[test]
    fn strided_or_mismatched_sources_are_left_to_mlx() {
        let mut buf = iota(&[1, 2, 16, 4], 0.0);
        let before = values(&buf);
        let strided = seq_slice(&iota(&[1, 2, 16, 4], 100.0), 2, 10).unwrap();
        assert!(!write_rows(&mut buf, 0, &strided, 0..8).unwrap());
        let other_dim = iota(&[1, 2, 8, 2], 0.0);
        assert!(!write_rows(&mut buf, 0, &other_dim, 0..8).unwrap());
        let other_dtype = iota(&[1, 2, 8, 4], 0.0).as_dtype(Dtype::Float16).unwrap();
        assert!(!write_rows(&mut buf, 0, &other_dtype, 0..8).unwrap());
        let short = iota(&[1, 2, 8, 4], 0.0);
        assert!(
            !write_rows(&mut buf, 12, &short, 0..8).unwrap(),
            "past the buffer's end"
        );
        assert_eq!(values(&buf), before, "nothing was written");
    }

    #[test]
    fn streaming_copies_are_exact_at_any_alignment_and_length() {
        let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
        for offset in [0, 1, 5, 15, 16, 17, 63] {
            for len in [0, 1, 15, 16, 63, 64, 65, 200, 1000, 4000 - offset] {
                for stream in [false, true] {
                    let mut dst = vec![0xAAu8; 4096];
                    copy_bytes(&mut dst[offset..offset + len], &src[3..3 + len], stream);
                    assert_eq!(
                        &dst[offset..offset + len],
                        &src[3..3 + len],
                        "{offset} {len} {stream}"
                    );
                    assert!(
                        dst[..offset].iter().all(|&b| b == 0xAA),
                        "{offset} {len} {stream}"
                    );
                    assert!(
                        dst[offset + len..].iter().all(|&b| b == 0xAA),
                        "{offset} {len} {stream}"
                    );
                }
            }
        }
    }

    #[test]
    fn large_writes_stream_and_stay_exact() {
        // 2 heads x 4096 positions x 64 f32 = 2 MiB per array: above STREAM_MIN_BYTES.
        let update = iota(&[1, 2, 4096, 64], 0.5);
        let mut buf = iota(&[1, 2, 4224, 64], -1.0);
        let want = expected(&buf, 100, &update, 0..4096);
        assert!(write_rows(&mut buf, 100, &update, 0..4096).unwrap());
        assert_eq!(values(&buf), want);
    }

    #[test]
    fn whole_copies_own_their_buffers() {
        let a = iota(&[2, 3, 4, 4], 0.0);
        let copy = whole_copy(&a).unwrap().unwrap();
        assert_ne!(address(&copy), address(&a));
        assert_eq!(values(&copy), values(&a));
        assert_eq!(copy.shape(), a.shape());
        let strided = seq_slice(&a, 1, 3).unwrap();
        assert!(whole_copy(&strided).unwrap().is_none());
    }

    /// What `compact_rows` must produce for one output, computed with mlx ops.
    fn joined(parts: &[(&Array, Range<usize>)]) -> Array {
        let slices: Vec<Array> = parts
            .iter()
            .map(|(a, r)| seq_slice(a, r.start, r.end).unwrap())
            .collect();
        let out = mlx_rs::ops::concatenate(&slices, 2).unwrap();
        out.eval().unwrap();
        out
    }

    #[test]
    fn compact_rows_join_runs_into_buffers_of_their_own() {
        let a = iota(&[2, 3, 16, 4], 0.0);
        let b = iota(&[2, 3, 5, 4], 1000.0);
        let outputs: [&[(&Array, Range<usize>)]; 3] =
            [&[(&a, 3..11)], &[(&a, 14..16), (&b, 0..5)], &[(&b, 2..3)]];
        let copies = compact_rows(&outputs).unwrap().unwrap();
        for (copy, parts) in copies.iter().zip(outputs) {
            let want = joined(parts);
            assert_eq!(copy.shape(), want.shape());
            assert_eq!(copy.dtype(), Dtype::Float32);
            assert_eq!(values(copy), values(&want));
            assert_eq!(
                host_bytes(copy).unwrap().unwrap().len(),
                copy.nbytes(),
                "row-contiguous, exactly its bytes"
            );
            for (src, _) in parts {
                assert_ne!(address(copy), address(src));
            }
        }
        // The sources are not pinned: an unshared one is still written in place.
        let mut a = a;
        let before = address(&a);
        assert!(write_rows(&mut a, 0, &b, 0..5).unwrap());
        assert_eq!(address(&a), before);
    }

    #[test]
    fn compact_rows_keep_any_dtype_bit_exact() {
        let a = iota(&[1, 2, 8, 4], 0.25);
        for dtype in [Dtype::Float16, Dtype::Bfloat16, Dtype::Uint8, Dtype::Int32] {
            let a = a.as_dtype(dtype).unwrap();
            a.eval().unwrap();
            let copy = compact_rows(&[&[(&a, 1..7)]]).unwrap().unwrap().remove(0);
            assert_eq!(copy.dtype(), dtype);
            let want = seq_slice(&a, 1, 7).unwrap();
            assert!(copy.eq_values(&want).unwrap(), "{dtype:?}");
        }
    }

    #[test]
    fn large_compact_rows_stream_and_stay_exact() {
        // 2 heads x 4096 positions x 64 f32 = 2 MiB: above STREAM_MIN_BYTES.
        let a = iota(&[1, 2, 4200, 64], 0.5);
        let copy = compact_rows(&[&[(&a, 99..4195)]]).unwrap().unwrap().remove(0);
        assert_eq!(values(&copy), values(&joined(&[(&a, 99..4195)])));
    }

    #[test]
    fn compact_rows_leave_strided_mismatched_or_empty_parts_to_mlx() {
        let a = iota(&[1, 2, 16, 4], 0.0);
        let strided = seq_slice(&a, 2, 10).unwrap();
        let other_dim = iota(&[1, 2, 8, 2], 0.0);
        assert!(compact_rows(&[&[(&strided, 0..8)]]).unwrap().is_none());
        assert!(compact_rows(&[&[(&a, 0..4)], &[(&a, 0..4), (&other_dim, 0..8)]])
            .unwrap()
            .is_none());
        assert!(compact_rows(&[&[(&a, 4..4)]]).unwrap().is_none());
        assert!(compact_rows(&[&[(&a, 10..17)]]).unwrap().is_none());
        assert!(compact_rows(&[&[]]).unwrap().is_none());
    }

    /// A reader of `plan` as `load_bytes` makes it, outside mlx.
    fn reader_of(dims: [usize; 4], plan: &Arc<Mutex<Option<RowPlan>>>) -> Reader {
        let payload = plan.lock().unwrap().as_ref().map_or(0, RowPlan::payload);
        Reader {
            header: npy_header(dims),
            pos: AtomicUsize::new(0),
            plan: Arc::clone(plan),
            payload,
        }
    }

    #[test]
    fn readers_serve_any_byte_range_and_nothing_once_closed() {
        let a = iota(&[1, 2, 6, 4], 0.0);
        let plan = plan_rows(&[(&a, 1..4), (&a, 5..6)]).unwrap().unwrap();
        assert_eq!(plan.payload(), 2 * 4 * 16);
        let state = Arc::new(Mutex::new(Some(plan)));
        let r = reader_of([1, 2, 4, 16], &state);
        assert_eq!(r.header.len() % 64, 0);
        let total = r.header.len() + r.payload;
        let mut whole = vec![0u8; total];
        // SAFETY (this and the reads below): `whole`, `pieces[at..]` and `past`
        // hold at least the `n` bytes asked for, and `a`, the plan's source,
        // is alive.
        assert_eq!(unsafe { read_at(&r, whole.as_mut_ptr().cast(), total, 0) }, total);
        assert_eq!(&whole[..r.header.len()], &r.header[..]);
        for chunk in [1, 7, 16, 100] {
            let mut pieces = vec![0u8; total];
            for at in (0..total).step_by(chunk) {
                let n = chunk.min(total - at);
                assert_eq!(unsafe { read_at(&r, pieces[at..].as_mut_ptr().cast(), n, at) }, n);
            }
            assert_eq!(pieces, whole, "chunks of {chunk}");
        }
        let mut past = [0xAAu8; 8];
        assert_eq!(unsafe { read_at(&r, past.as_mut_ptr().cast(), 8, total) }, 0);
        *state.lock().unwrap() = None;
        assert_eq!(
            unsafe { read_at(&r, past.as_mut_ptr().cast(), 8, 0) },
            0,
            "closed"
        );
        assert_eq!(past, [0xAA; 8], "a closed reader writes nothing");
        let bytes: Vec<f32> = whole[r.header.len()..]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(bytes, values(&joined(&[(&a, 1..4), (&a, 5..6)])));
    }

    // Finding 1: the destination of an in-place write is derived from mlx's
    // data pointer, not from a shared slice; the write still lands in place
    // and leaves the source alone.
    #[test]
    fn in_place_writes_leave_the_source_intact() {
        let update = iota(&[1, 2, 6, 4], 500.0);
        let update_before = values(&update);
        let mut buf = iota(&[1, 2, 8, 4], 0.0);
        let want = expected(&buf, 1, &update, 0..6);
        let before = address(&buf);
        assert!(write_rows(&mut buf, 1, &update, 0..6).unwrap());
        assert_eq!(address(&buf), before, "written in place");
        assert_eq!(values(&buf), want);
        assert_eq!(values(&update), update_before);
    }

    // Finding 2: a one-row buffer given a one-row update becomes the update
    // itself (mlx's whole-array `slice_update` shortcut); `write_rows` must
    // then write nothing through it, and the update keeps its values through
    // any number of such writes.
    #[test]
    fn a_one_row_buffer_shares_the_update_and_is_never_written_through() {
        let snap = iota(&[1, 2, 1, 4], 700.0);
        let snap_before = values(&snap);
        let mut buf = iota(&[1, 2, 1, 4], 0.0);
        for _ in 0..2 {
            assert!(write_rows(&mut buf, 0, &snap, 0..1).unwrap());
            assert_eq!(
                address(&buf),
                address(&snap),
                "mlx hands back the update itself: the case is reached"
            );
            assert_eq!(values(&buf), snap_before);
            assert_eq!(values(&snap), snap_before);
        }
        // A next one-row write replaces `buf`, never the shared buffer.
        let other = iota(&[1, 2, 1, 4], 900.0);
        assert!(write_rows(&mut buf, 0, &other, 0..1).unwrap());
        assert_eq!(values(&buf), values(&other));
        assert_eq!(values(&snap), snap_before, "the snapshot was not written");
    }

    // Finding 2, with more rows: a buffer that shares the source's buffer is
    // copied by the first row's `slice_update` before any row is written
    // through its pointer, so the source keeps its values.
    #[test]
    fn a_buffer_sharing_the_source_is_copied_before_rows_are_written() {
        let update = iota(&[1, 2, 4, 4], 300.0);
        let update_before = values(&update);
        let mut buf = update.clone();
        // `buf` and `update` share one buffer: mlx cannot donate it, so the
        // first row's `slice_update` copies it, and the rows land in the copy.
        let want = expected(&buf, 0, &update, 1..4);
        assert!(write_rows(&mut buf, 0, &update, 1..4).unwrap());
        assert_ne!(address(&buf), address(&update));
        assert_eq!(values(&buf), want);
        assert_eq!(values(&update), update_before);
    }

    // Finding 3: a read after the plan was closed (a late read on mlx's io
    // pool after a failed evaluation, whose output buffer may be freed) makes
    // no reference to the destination at all: with a null or a dangling
    // pointer it returns 0 (an error for mlx's reader) and touches nothing.
    // Building the slice first, as before, is a null `&mut [u8]`, which the
    // standard library's debug checks abort on.
    #[test]
    fn reads_after_close_make_no_reference_to_the_destination() {
        let a = iota(&[1, 2, 6, 4], 0.0);
        let plan = plan_rows(&[(&a, 0..6)]).unwrap().unwrap();
        let state = Arc::new(Mutex::new(Some(plan)));
        let r = reader_of([1, 2, 6, 16], &state);
        drop(OpenPlans(vec![Arc::clone(&state)]));
        assert!(state.lock().unwrap().is_none(), "closed by the guard");
        let dangling = {
            let freed = Box::new([0u8; 64]);
            freed.as_ptr().cast_mut()
        };
        for data in [std::ptr::null_mut(), dangling] {
            for off in [0, r.header.len(), r.header.len() + 8] {
                // SAFETY: the plan is closed, so `read_at` may be given any
                // pointer (its contract) and must not use it.
                assert_eq!(unsafe { read_at(&r, data.cast(), 16, off) }, 0);
            }
        }
        // The same through mlx's callbacks, on a descriptor as `load_bytes`
        // makes it.
        let desc = Box::into_raw(Box::new(reader_of([1, 2, 6, 16], &state))).cast::<c_void>();
        // SAFETY: `desc` is a live reader descriptor until `reader_free`, and
        // its plan is closed, so the data pointer may be null.
        unsafe {
            assert_eq!(reader_read_at(desc, std::ptr::null_mut(), 16, 0), 0);
            assert_eq!(reader_read(desc, std::ptr::null_mut(), 16), 0);
            assert_eq!(reader_tell(desc), 0, "nothing read");
            reader_free(desc);
        }
    }

    // Finding 3, end to end: an array loaded from a plan that is closed before
    // mlx reads it fails to evaluate instead of reading the plan's sources
    // (dropped here) or writing its output.
    #[test]
    fn a_load_evaluated_after_close_fails_without_reading() {
        let a = iota(&[1, 2, 6, 4], 0.0);
        let plan = plan_rows(&[(&a, 0..6)]).unwrap().unwrap();
        let state = Arc::new(Mutex::new(Some(plan)));
        let open = OpenPlans(vec![Arc::clone(&state)]);
        // SAFETY: `open` closes the plan below, before `a` (its source) is
        // dropped and before the loaded array is evaluated or dropped.
        let bytes = unsafe { load_bytes([1, 2, 6, 16], state) }.unwrap();
        drop(open);
        drop(a);
        assert!(bytes.eval().is_err(), "a read of a closed plan is an error");
    }

    // Finding 4: the plans are closed by a guard, so a panic between loading
    // and closing (out of an evaluation) still closes them.
    #[test]
    fn plans_are_closed_when_a_panic_unwinds() {
        let a = iota(&[1, 2, 6, 4], 0.0);
        let plan = plan_rows(&[(&a, 0..6)]).unwrap().unwrap();
        let state = Arc::new(Mutex::new(Some(plan)));
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _open = OpenPlans(vec![Arc::clone(&state)]);
            panic!("an evaluation panics");
        }));
        assert!(caught.is_err());
        assert!(state.lock().unwrap_or_else(|e| e.into_inner()).is_none());
        let r = reader_of([1, 2, 6, 16], &state);
        let mut out = [0x55u8; 16];
        // SAFETY: `out` holds the 16 bytes asked for.
        assert_eq!(unsafe { read_at(&r, out.as_mut_ptr().cast(), 16, 0) }, 0);
        assert_eq!(out, [0x55; 16]);
    }
}
