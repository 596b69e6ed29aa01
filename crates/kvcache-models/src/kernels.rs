//! CPU kernels for the two element-wise stages of a transformer layer that
//! candle composes from many whole-tensor passes: attention's masked softmax
//! and the feed-forward's gated activation.
//!
//! candle runs `softmax(scores * scale + mask)` as seven passes, each into a
//! fresh tensor the size of `scores`, and its `gelu`/`silu` as one scalar
//! `tanhf`/`expf` call per element on one thread; at prefill sizes on a
//! 2-core machine those passes cost a fifth of a Gemma forward. Here each is
//! one pass per row: vectorized (AVX2 and FMA where the CPU has them, chosen
//! at run time), rows spread over candle's thread pool, `e^x` from a
//! polynomial instead of libm.
//!
//! What the passes do not handle (another device, a dtype other than f32,
//! shapes that do not fit) goes to candle's operations instead: the same
//! values within float rounding. The helpers
//! that spread rows or columns over the pool serve [`crate::q8`] as well.

use std::ops::Range;

use candle_core::{DType, Storage, Tensor, D};

use crate::{ModelError, Result};

/// The activation of a gated feed-forward `down(act(gate(x)) * up(x))`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// GELU, tanh approximation (PyTorch's `gelu(approximate="tanh")`, Gemma's).
    GeluTanh,
    /// SiLU, `x * sigmoid(x)` (the Llama's).
    Silu,
}

/// Below this many elements a kernel runs on the calling thread: waking the
/// pool costs more than it saves (decode steps).
const PARALLEL_FROM: usize = 32 * 1024;

/// `softmax(scores * scale + mask)` over the last dimension: `scores: [heads,
/// rows, cells]`, whose row `r` takes mask row `r % n` of `mask: [n, cells]`
/// (0 visible, `-inf` hidden); every row needs a visible cell. Returns
/// `[heads, rows, cells]`: one pass per row for f32 on the CPU, candle's
/// operations otherwise.
pub(crate) fn masked_softmax(scores: &Tensor, mask: &Tensor, scale: f32) -> Result<Tensor> {
    match masked_softmax_cpu(scores, mask, scale)? {
        Some(probs) => Ok(probs),
        None => candle_masked_softmax(scores, mask, scale),
    }
}

/// `act(gate) * up` element by element (`gate` and `up` of one shape): one
/// pass per row for f32 on the CPU, candle's operations otherwise.
pub(crate) fn gated(gate: &Tensor, up: &Tensor, act: Activation) -> Result<Tensor> {
    match gated_cpu(gate, up, act)? {
        Some(out) => Ok(out),
        None => candle_gated(gate, up, act),
    }
}

/// [`masked_softmax`] as candle's passes.
fn candle_masked_softmax(scores: &Tensor, mask: &Tensor, scale: f32) -> Result<Tensor> {
    let (heads, rows, cells) = scores.dims3()?;
    let n = mask.dim(0)?;
    if n == 0 || rows % n != 0 {
        return Err(ModelError::InvalidArgument(format!(
            "{rows} score rows do not take a mask of {n} rows"
        )));
    }
    let scores = (scores * f64::from(scale))?.reshape((heads, rows / n, n, cells))?;
    Ok(softmax_last(&scores.broadcast_add(mask)?)?.reshape((heads, rows, cells))?)
}

/// Softmax over the last dimension; rows need at least one finite entry.
fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&max)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?)
}

/// [`gated`] as candle's operations.
fn candle_gated(gate: &Tensor, up: &Tensor, act: Activation) -> Result<Tensor> {
    let activated = match act {
        Activation::GeluTanh => gate.gelu()?,
        Activation::Silu => gate.silu()?,
    };
    Ok((activated * up)?)
}

/// [`masked_softmax`] in one pass per row, for f32 tensors on the CPU (`None`
/// otherwise).
fn masked_softmax_cpu(scores: &Tensor, mask: &Tensor, scale: f32) -> Result<Option<Tensor>> {
    let (heads, rows, cells) = scores.dims3()?;
    let (n, mask_cells) = mask.dims2()?;
    if !scores.device().is_cpu()
        || scores.dtype() != DType::F32
        || mask.dtype() != DType::F32
        || mask_cells != cells
        || n == 0
        || cells == 0
        || rows % n != 0
    {
        return Ok(None);
    }
    let (scores, mask) = (scores.contiguous()?, mask.contiguous()?);
    let mut out = vec![0f32; heads * rows * cells];
    {
        let (Some(src), Some(mask)) = (cpu_f32(&scores)?, cpu_f32(&mask)?) else {
            return Ok(None);
        };
        for_rows(&mut out, cells, |r, dst| {
            let start = r * cells;
            let m = &mask[(r % n) * cells..][..cells];
            softmax_row(dst, &src[start..start + cells], m, scale);
        });
    }
    Ok(Some(Tensor::from_vec(
        out,
        (heads, rows, cells),
        scores.device(),
    )?))
}

/// [`gated`] in one pass per row, for f32 tensors of one shape on the CPU
/// (`None` otherwise).
fn gated_cpu(gate: &Tensor, up: &Tensor, act: Activation) -> Result<Option<Tensor>> {
    if !gate.device().is_cpu()
        || gate.dtype() != DType::F32
        || up.dtype() != DType::F32
        || gate.dims() != up.dims()
        || gate.elem_count() == 0
    {
        return Ok(None);
    }
    let (gate, up) = (gate.contiguous()?, up.contiguous()?);
    let len = gate.elem_count();
    let mut out = vec![0f32; len];
    {
        let (Some(g), Some(u)) = (cpu_f32(&gate)?, cpu_f32(&up)?) else {
            return Ok(None);
        };
        // Rows of a fixed length, so that the pool gets pieces to share.
        let row = gate.dims().last().copied().unwrap_or(len).max(1);
        for_rows(&mut out, row, |r, dst| {
            let start = r * row;
            gated_row(dst, &g[start..start + row], &u[start..start + row], act);
        });
    }
    Ok(Some(Tensor::from_vec(out, gate.shape(), gate.device())?))
}

/// The f32 elements of a contiguous CPU tensor, or `None`.
fn cpu_f32(t: &Tensor) -> Result<Option<CpuSlice<'_>>> {
    let (storage, layout) = t.storage_and_layout();
    if !matches!(&*storage, Storage::Cpu(_)) {
        return Ok(None);
    }
    let start = layout.start_offset();
    Ok(Some(CpuSlice {
        storage,
        start,
        len: t.elem_count(),
    }))
}

/// A contiguous f32 CPU tensor's elements, borrowed.
struct CpuSlice<'a> {
    storage: candle_core::StorageRef<'a>,
    start: usize,
    len: usize,
}

impl std::ops::Deref for CpuSlice<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match &*self.storage {
            Storage::Cpu(cpu) => match cpu.as_slice::<f32>() {
                Ok(all) => &all[self.start..self.start + self.len],
                Err(_) => unreachable!("cpu_f32 is only called on f32 tensors"),
            },
            _ => unreachable!("cpu_f32 checked the device"),
        }
    }
}

/// Whether `elements` of work are enough to wake candle's thread pool, and
/// the pool has threads to wake. (Asks the pool itself: candle's
/// `get_num_threads` may re-read `/proc/cpuinfo` on each call.)
fn worth_the_pool(elements: usize) -> bool {
    elements >= PARALLEL_FROM && candle_core::utils::barrier_pool().n_workers() > 0
}

/// Calls `f(r, row)` for every row `r` of `out` (rows of `len` elements), on
/// candle's thread pool when there is enough work.
fn for_rows(out: &mut [f32], len: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    let rows = out.len() / len;
    if !worth_the_pool(out.len()) {
        out.chunks_exact_mut(len)
            .enumerate()
            .for_each(|(r, row)| f(r, row));
        return;
    }
    let shared = SharedRows(out.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(rows, |range| {
        for r in range {
            // SAFETY: the pool hands every row index in 0..rows out exactly
            // once, so each slice is a distinct in-bounds row of `out`, which
            // outlives the call.
            let row = unsafe { std::slice::from_raw_parts_mut(shared.row(r * len), len) };
            f(r, row);
        }
    });
}

/// Calls `f(i)` for every item `i` in `0..items`, on candle's thread pool
/// when `work` (the items' work together, in elements of an element-wise
/// pass) is enough to wake it, else on the calling thread.
pub(crate) fn for_items(items: usize, work: usize, f: impl Fn(usize) + Sync) {
    if items <= 1 || !worth_the_pool(work) {
        (0..items).for_each(f);
        return;
    }
    candle_core::utils::barrier_pool().execute_chunked(items, |range| range.for_each(&f));
}

/// Calls `f(columns, writer)` for chunks of the columns `0..width` of `out`
/// (row-major, rows of `width`), on candle's thread pool when there is enough
/// work; `writer` sets elements of `out` in its chunk's columns only.
pub(crate) fn for_columns(out: &mut [f32], width: usize, f: impl Fn(Range<usize>, &mut Columns<'_>) + Sync) {
    let shared = SharedRows(out.as_mut_ptr());
    let len = out.len();
    let run = |columns: Range<usize>| {
        let mut writer = Columns {
            out: &shared,
            len,
            width,
            columns: columns.clone(),
            _out: std::marker::PhantomData,
        };
        f(columns, &mut writer);
    };
    if !worth_the_pool(len) {
        run(0..width);
        return;
    }
    candle_core::utils::barrier_pool().execute_chunked(width, run);
}

/// Writes into one chunk of columns of [`for_columns`]'s output.
pub(crate) struct Columns<'a> {
    out: &'a SharedRows,
    len: usize,
    width: usize,
    columns: Range<usize>,
    _out: std::marker::PhantomData<&'a mut [f32]>,
}

impl Columns<'_> {
    /// `out[row * width + column] = value`; the column must be in this chunk.
    pub(crate) fn set(&mut self, row: usize, column: usize, value: f32) {
        let at = row * self.width + column;
        assert!(
            self.columns.contains(&column) && at < self.len,
            "column {column} outside {:?}",
            self.columns
        );
        // SAFETY: `at` is in bounds, and its column belongs to this chunk
        // alone (the pool hands each column out once), so no other thread
        // writes it while the output lives.
        unsafe { *self.out.row(at) = value };
    }
}

/// `out`'s start, shared by the threads of [`for_rows`] and [`for_columns`]
/// (each writes only its own rows or columns).
struct SharedRows(*mut f32);

// SAFETY: only used by `for_rows` and `for_columns`, whose threads write
// disjoint elements.
unsafe impl Sync for SharedRows {}

impl SharedRows {
    fn row(&self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// One row of [`masked_softmax`], through the widest instructions the CPU has.
fn softmax_row(dst: &mut [f32], src: &[f32], mask: &[f32], scale: f32) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA, all that `softmax_row_avx2` needs.
        unsafe { softmax_row_avx2(dst, src, mask, scale) };
        return;
    }
    softmax_row_generic(dst, src, mask, scale);
}

/// One row of [`gated`], through the widest instructions the CPU has.
fn gated_row(dst: &mut [f32], gate: &[f32], up: &[f32], act: Activation) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA, all that `gated_row_avx2` needs.
        unsafe { gated_row_avx2(dst, gate, up, act) };
        return;
    }
    gated_row_generic(dst, gate, up, act);
}

#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx2_fma() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_row_avx2(dst: &mut [f32], src: &[f32], mask: &[f32], scale: f32) {
    softmax_row_generic(dst, src, mask, scale);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gated_row_avx2(dst: &mut [f32], gate: &[f32], up: &[f32], act: Activation) {
    gated_row_generic(dst, gate, up, act);
}

/// Lanes of the reductions: eight independent accumulators, which the
/// compiler keeps in one vector register (a single running sum would be a
/// chain it may not reorder).
const LANES: usize = 8;

#[inline(always)]
fn softmax_row_generic(dst: &mut [f32], src: &[f32], mask: &[f32], scale: f32) {
    let mut max = [f32::NEG_INFINITY; LANES];
    let mut d8 = dst.chunks_exact_mut(LANES);
    let mut s8 = src.chunks_exact(LANES);
    let mut m8 = mask.chunks_exact(LANES);
    for ((d, s), m) in (&mut d8).zip(&mut s8).zip(&mut m8) {
        for i in 0..LANES {
            d[i] = s[i] * scale + m[i];
            max[i] = if d[i] > max[i] { d[i] } else { max[i] };
        }
    }
    let mut max = max.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for ((d, &s), &m) in d8
        .into_remainder()
        .iter_mut()
        .zip(s8.remainder())
        .zip(m8.remainder())
    {
        *d = s * scale + m;
        max = max.max(*d);
    }
    let mut sum = [0f32; LANES];
    let mut d8 = dst.chunks_exact_mut(LANES);
    for d in &mut d8 {
        for i in 0..LANES {
            d[i] = exp(d[i] - max);
            sum[i] += d[i];
        }
    }
    let mut sum: f32 = sum.iter().sum();
    for d in d8.into_remainder() {
        *d = exp(*d - max);
        sum += *d;
    }
    let inv = 1.0 / sum;
    for d in dst.iter_mut() {
        *d *= inv;
    }
}

#[inline(always)]
fn gated_row_generic(dst: &mut [f32], gate: &[f32], up: &[f32], act: Activation) {
    // Both activations are `v / (1 + e^(-k(v)))`: SiLU with `k(v) = v`, the
    // tanh GELU with `k(v) = 2 sqrt(2/pi) (v + 0.044715 v^3)`, since
    // `0.5 (1 + tanh(u)) = 1 / (1 + e^(-2u))`.
    const GELU_K: f32 = 2.0 * 0.797_884_6; // 2 sqrt(2 / pi)
    match act {
        Activation::Silu => {
            for ((d, &v), &u) in dst.iter_mut().zip(gate).zip(up) {
                *d = v / (1.0 + exp(-v)) * u;
            }
        }
        Activation::GeluTanh => {
            for ((d, &v), &u) in dst.iter_mut().zip(gate).zip(up) {
                let k = GELU_K * (v + 0.044_715 * v * v * v);
                *d = v / (1.0 + exp(-k)) * u;
            }
        }
    }
}

/// `e^x` in f32, within 2 ulp of libm's between -87 and 88; 0 below `-87.3`
/// (so a `-inf` mask gives exactly 0), `e^88` (half of `f32::MAX`) above 88. Plain arithmetic the compiler vectorizes: `x =
/// n ln 2 + r` with `|r| <= ln 2 / 2`, a degree-6 polynomial for `e^r`, and
/// `2^n` built in the exponent bits.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LO: f32 = -87.336_55; // ln(f32::MIN_POSITIVE)
    const HI: f32 = 88.0; // keeps n <= 127, a normal 2^n
                          // ln 2 split so that `n * LN2_HI` is exact for the n in range.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(LO, HI);
    // `xc log2(e) + ROUND` holds n = round(xc log2(e)) in its low mantissa bits.
    let shifted = xc * std::f32::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;
    // Taylor's coefficients, nudged for the interval (the Cephes `expf` set).
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let er = p * r * r + r + 1.0;
    // n is in -126..=127: 2^n is a normal number, exponent bits n + 127. The
    // integer comes from the bits (a float-to-int `as` would saturate, which
    // does not vectorize).
    let n_bits = shifted.to_bits().wrapping_sub(ROUND.to_bits());
    let y = er * f32::from_bits(n_bits.wrapping_add(127) << 23);
    if x < LO {
        0.0
    } else {
        y
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, D};

    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_libm_over_the_normal_range() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp(x), x.exp());
            let ulp = f32::from_bits(want.to_bits() + 1) - want;
            worst = worst.max((got - want).abs() / ulp);
            x += 0.003_7;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(100.0).is_finite() && exp(100.0) > 1e38);
    }

    fn random(shape: &[usize], seed: u64) -> Tensor {
        let mut rng = crate::weights::SplitMix64(seed);
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.next_sym() * 4.0).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        crate::testing::max_abs_diff(a, b)
    }

    #[test]
    fn masked_softmax_equals_candles_passes() {
        // Big enough for the thread pool, rows of odd length (a remainder
        // after the 8 lanes), a causal mask with hidden cells in every row.
        for (heads, n, cells) in [(1, 3, 5), (4, 24, 701)] {
            let scores = random(&[heads, 2 * n, cells], 1);
            let mask = crate::gemma::causal_mask(
                &(cells - n..cells).map(|p| p as i32).collect::<Vec<_>>(),
                &(0..cells).map(|p| p as i32).collect::<Vec<_>>(),
                Some(cells / 2),
                &Device::Cpu,
            )
            .unwrap();
            let got = masked_softmax_cpu(&scores, &mask, 0.3).unwrap().unwrap();
            let want = candle_masked_softmax(&scores, &mask, 0.3).unwrap();
            assert!(
                max_diff(&got, &want) < 1e-6,
                "{heads}x{n}x{cells}: {}",
                max_diff(&got, &want)
            );
            // Hidden cells get exactly 0, every row sums to 1.
            let hidden = mask
                .broadcast_as((heads, 2, n, cells))
                .unwrap()
                .reshape((heads, 2 * n, cells))
                .unwrap();
            let g = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let h = hidden.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(g.iter().zip(&h).all(|(p, m)| *m == 0.0 || *p == 0.0));
            let sums = got
                .sum_keepdim(D::Minus1)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            assert!(sums.iter().all(|s| (s - 1.0).abs() < 1e-5), "{sums:?}");
        }
    }

    #[test]
    fn masked_softmax_declines_what_it_does_not_handle() {
        let scores = random(&[2, 6, 4], 2);
        let mask = Tensor::zeros((4, 4), DType::F32, &Device::Cpu).unwrap();
        // 6 rows are not a whole number of 4-row masks.
        assert!(masked_softmax_cpu(&scores, &mask, 1.0).unwrap().is_none());
        let f64_scores = scores.to_dtype(DType::F64).unwrap();
        let mask3 = Tensor::zeros((3, 4), DType::F32, &Device::Cpu).unwrap();
        assert!(masked_softmax_cpu(&f64_scores, &mask3, 1.0).unwrap().is_none());
        assert!(masked_softmax_cpu(&scores, &mask3, 1.0).unwrap().is_some());
    }

    #[test]
    fn gated_activations_equal_candles() {
        for shape in [vec![3, 5], vec![40, 2048]] {
            let gate = random(&shape, 3);
            let up = random(&shape, 4);
            let silu = gated_cpu(&gate, &up, Activation::Silu).unwrap().unwrap();
            let want = (gate.silu().unwrap() * &up).unwrap();
            assert!(
                max_diff(&silu, &want) < 1e-5,
                "silu {shape:?}: {}",
                max_diff(&silu, &want)
            );
            let gelu = gated_cpu(&gate, &up, Activation::GeluTanh).unwrap().unwrap();
            let want = (gate.gelu().unwrap() * &up).unwrap();
            assert!(
                max_diff(&gelu, &want) < 1e-5,
                "gelu {shape:?}: {}",
                max_diff(&gelu, &want)
            );
        }
        // Shapes that differ: declined.
        let (a, b) = (random(&[2, 3], 5), random(&[3, 2], 6));
        assert!(gated_cpu(&a, &b, Activation::Silu).unwrap().is_none());
    }
}
