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
use std::sync::{Arc, Mutex};

use kvcache_api::Result;
use mlx_rs::ops::indexing::TryIndexMutOp;
use mlx_rs::Array;

use super::arrays::{backend, dim, seq_len, seq_slice};

/// The data of `a` as bytes, when `a` is evaluated and row-contiguous (a
/// compact array or a whole buffer, not a strided view); `None` otherwise.
fn host_bytes(a: &Array) -> Result<Option<&[u8]>> {
    a.eval().map_err(backend)?;
    let mut row_contiguous = false;
    // SAFETY: `a` is a valid, evaluated array handle for the duration of the call,
    // and `row_contiguous` outlives it.
    let rc = unsafe { mlx_sys::_mlx_array_is_row_contiguous(&mut row_contiguous, a.as_ptr()) };
    if rc != 0 || !row_contiguous || a.nbytes() == 0 {
        return Ok(None);
    }
    // SAFETY: an evaluated row-contiguous array's data is `nbytes` contiguous
    // bytes starting at its data pointer (`data<uint8_t>()` is that pointer
    // whatever the dtype); mlx never writes to an evaluated array's buffer while
    // `a` holds it, and the slice borrows `a`, so the buffer outlives it.
    let data = unsafe { mlx_sys::mlx_array_data_uint8(a.as_ptr()) };
    if data.is_null() {
        return Ok(None);
    }
    // SAFETY: see above.
    Ok(Some(unsafe { std::slice::from_raw_parts(data, a.nbytes()) }))
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
/// possible. Returns `false`, having changed nothing, when the host path does
/// not apply (a strided `update`, other shapes or dtypes, positions out of
/// range), for the caller to use mlx ops instead.
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
    let Some(dst) = host_bytes(buf)? else {
        // A slice_update of a whole buffer is row-contiguous; should mlx ever
        // answer otherwise, the caller rewrites every row through mlx.
        return Ok(false);
    };
    let (ptr, len) = (dst.as_ptr().cast_mut(), dst.len());
    // SAFETY: `buf` was just produced by an evaluated `slice_update` whose input
    // handle we dropped before evaluation: its buffer was either donated by mlx
    // (which it does only when no other array shares the buffer) or newly
    // allocated for it. No view of `buf` has been made since, so no other
    // array, graph node or slice can read or write these bytes while the copy
    // runs; `buf` keeps them alive, and `src` is another array's buffer
    // (`update` is a distinct, evaluated array: a write cannot alias it, since
    // sharing its buffer would have prevented the donation).
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
/// readers are closed before returning (a late read would fail rather than
/// touch the parts).
pub(crate) fn compact_rows(outputs: &[RowParts<'_>]) -> Result<Option<Vec<Array>>> {
    let mut plans = Vec::with_capacity(outputs.len());
    for parts in outputs {
        let Some(plan) = plan_rows(parts)? else {
            return Ok(None);
        };
        plans.push(plan);
    }
    let mut states = Vec::with_capacity(plans.len());
    let mut loaded = Vec::with_capacity(plans.len());
    for (plan, parts) in plans.into_iter().zip(outputs) {
        let (first, _) = parts[0];
        let shape = first.shape();
        let dims = [shape[0] as usize, shape[1] as usize, plan.rows, plan.row];
        let state = Arc::new(Mutex::new(Some(plan)));
        states.push(Arc::clone(&state));
        let bytes = load_bytes(dims, state)?;
        let copy = if first.dtype() == mlx_rs::Dtype::Uint8 {
            bytes
        } else {
            bytes.view_dtype(first.dtype()).map_err(backend)?
        };
        loaded.push(copy);
    }
    let evaluated = super::arrays::eval(&loaded);
    for state in &states {
        *state.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
    evaluated?;
    Ok(Some(loaded))
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
        let Some(bytes) = host_bytes(a)? else {
            return Ok(None);
        };
        geom = Some(g);
        runs.push(SourceRun {
            data: bytes.as_ptr(),
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

// SAFETY: the plan's pointers are read only by the reader, under the mutex that
// `compact_rows` takes to close it; until then the parts it borrows keep the
// buffers alive and unchanged (evaluated mlx buffers are never written while
// arrays hold them).
unsafe impl Send for RowPlan {}

impl RowPlan {
    fn payload(&self) -> usize {
        self.heads * self.rows * self.row
    }

    /// Copies payload bytes `[at, at + dst.len())` into `dst`.
    fn copy_to(&self, dst: &mut [u8], at: usize) {
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
                    // bytes (checked in `plan_rows`), which are alive and
                    // unchanged while the plan is open (see `RowPlan`'s Send).
                    let src = unsafe { std::slice::from_raw_parts(run.data.add(s), hi - lo) };
                    copy_bytes(&mut dst[lo - at..hi - at], src, stream);
                }
                pos += n;
            }
        }
    }
}

/// The descriptor behind an mlx `io::Reader`: a `.npy` header, then the bytes
/// the plan copies; `plan` is `None` once closed.
struct Reader {
    header: Vec<u8>,
    pos: usize,
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
fn load_bytes(dims: [usize; 4], plan: Arc<Mutex<Option<RowPlan>>>) -> Result<Array> {
    let payload = plan
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .map_or(0, RowPlan::payload);
    let reader = Box::new(Reader {
        header: npy_header(dims),
        pos: 0,
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
    // handle below, the parsing in `load`, the `Load` primitive); every
    // callback treats `desc` as that `Reader`. The stream handle is freed after
    // use and `res` is a fresh array handle that `Array::from_ptr` takes over.
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
/// `desc` must be the pointer `load_bytes` gave mlx, not yet freed, and not in
/// use by another callback at the same time (mlx calls a reader from one
/// thread at a time: the header while `load` parses it, the data once, from
/// the `Load` task).
unsafe fn reader<'a>(desc: *mut c_void) -> &'a mut Reader {
    // SAFETY: see the function's contract.
    unsafe { &mut *desc.cast::<Reader>() }
}

extern "C" fn reader_true(_: *mut c_void) -> bool {
    true
}

extern "C" fn reader_tell(desc: *mut c_void) -> usize {
    // SAFETY: called by mlx with the descriptor of a live reader.
    unsafe { reader(desc) }.pos
}

extern "C" fn reader_seek(desc: *mut c_void, off: i64, whence: c_int) -> c_int {
    // SAFETY: called by mlx with the descriptor of a live reader.
    let r = unsafe { reader(desc) };
    let base = match whence {
        libc_seek::SET => 0,
        libc_seek::CUR => r.pos as i64,
        libc_seek::END => (r.header.len() + r.payload) as i64,
        _ => return -1,
    };
    match usize::try_from(base + off) {
        Ok(pos) => {
            r.pos = pos;
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

extern "C" fn reader_read(desc: *mut c_void, data: *mut c_char, n: usize) -> usize {
    // SAFETY: called by mlx with the descriptor of a live reader.
    let r = unsafe { reader(desc) };
    let at = r.pos;
    let read = read_at(r, data, n, at);
    r.pos += read;
    read
}

extern "C" fn reader_read_at(desc: *mut c_void, data: *mut c_char, n: usize, off: usize) -> usize {
    // SAFETY: called by mlx with the descriptor of a live reader; only shared
    // access is taken, so even concurrent reads of parts of the data (which mlx
    // 0.32 does not make) would not alias a `&mut`: the plan is behind a mutex.
    read_at(unsafe { &*desc.cast::<Reader>() }, data, n, off)
}

/// Reads up to `n` bytes at `off` of the header-then-payload stream into
/// `data` (mlx's `n` writable bytes); returns how many, 0 once closed.
fn read_at(r: &Reader, data: *mut c_char, n: usize, off: usize) -> usize {
    let total = r.header.len() + r.payload;
    let n = n.min(total.saturating_sub(off));
    if n == 0 {
        return 0;
    }
    // SAFETY: mlx passes `n` (or more) writable bytes at `data` that nothing
    // else uses during the call: a header scratch buffer, or the `Load`
    // output, allocated for this array alone and not yet visible to anyone.
    let dst = unsafe { std::slice::from_raw_parts_mut(data.cast::<u8>(), n) };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let guard = r.plan.lock().unwrap_or_else(|e| e.into_inner());
        let Some(plan) = guard.as_ref() else {
            return 0;
        };
        let header = r.header.len();
        let split = header.saturating_sub(off).min(n);
        dst[..split].copy_from_slice(&r.header[off.min(header)..off.min(header) + split]);
        if split < n {
            plan.copy_to(&mut dst[split..], off + split - header);
        }
        n
    }));
    result.unwrap_or(0)
}

extern "C" fn reader_write(_: *mut c_void, _: *const c_char, _: usize) -> usize {
    0
}

extern "C" fn reader_label(_: *mut c_void) -> *const c_char {
    c"kvcache-mlx row copy".as_ptr()
}

extern "C" fn reader_free(desc: *mut c_void) {
    // SAFETY: mlx calls `free` once, when the last reference to the reader
    // goes; `desc` came from `Box::into_raw` in `load_bytes`.
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

    #[test]
    fn readers_serve_any_byte_range_and_nothing_once_closed() {
        let a = iota(&[1, 2, 6, 4], 0.0);
        let plan = plan_rows(&[(&a, 1..4), (&a, 5..6)]).unwrap().unwrap();
        let payload = plan.payload();
        assert_eq!(payload, 2 * 4 * 16);
        let state = Arc::new(Mutex::new(Some(plan)));
        let r = Reader {
            header: npy_header([1, 2, 4, 16]),
            pos: 0,
            plan: Arc::clone(&state),
            payload,
        };
        assert_eq!(r.header.len() % 64, 0);
        let total = r.header.len() + payload;
        let mut whole = vec![0u8; total];
        assert_eq!(read_at(&r, whole.as_mut_ptr().cast(), total, 0), total);
        assert_eq!(&whole[..r.header.len()], &r.header[..]);
        for chunk in [1, 7, 16, 100] {
            let mut pieces = vec![0u8; total];
            for at in (0..total).step_by(chunk) {
                let n = chunk.min(total - at);
                assert_eq!(read_at(&r, pieces[at..].as_mut_ptr().cast(), n, at), n);
            }
            assert_eq!(pieces, whole, "chunks of {chunk}");
        }
        let mut past = [0u8; 8];
        assert_eq!(read_at(&r, past.as_mut_ptr().cast(), 8, total), 0);
        *state.lock().unwrap() = None;
        assert_eq!(read_at(&r, past.as_mut_ptr().cast(), 8, 0), 0, "closed");
        let bytes: Vec<f32> = whole[r.header.len()..]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(bytes, values(&joined(&[(&a, 1..4), (&a, 5..6)])));
    }
}
