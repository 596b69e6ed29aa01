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
//!
//! Everything else (strided sources, callers' arrays, other platforms) goes
//! through mlx ops, which is always correct.

use std::ops::Range;

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
}
