//! The CPU paged-attention kernel, [`paged_attention`], which
//! walks each row's runs in tiles of 64 cells (see its documentation).

use std::ops::Range;
use std::sync::Mutex;

use candle_core::{Device, Storage, StorageRef, Tensor};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use kvcache_api::{CellRun, PagedKv, RowRuns, StoredKv};

use super::stored::{all_on, Geometry, StoredShape, StoredType, Strides};
use crate::kernels;
use crate::Result;

/// Cells per tile of [`paged_attention`]: one `u64` mask per row.
const TILE: usize = 64;

/// Most rows in one block of [`paged_attention`].
const BLOCK_ROWS: usize = 16;

/// Up to this many queries on a tile (a block's rows times the query heads of
/// one key/value head: a decode row's few heads), scores are dot products over
/// the tile's keys as stored, row by row; beyond, the keys are transposed once
/// so that every query's scores are plain multiply-adds across the tile (the
/// transposition, a scalar store per element, pays only when shared).
const DOT_QUERIES: usize = 8;

/// Attention of `q: [n, n_heads, head_dim]` (f32) over the cells each row of
/// `view` sees, scores scaled by `scale`; query head `j * g + i` uses key/value
/// head `j` (`g = n_heads / kv_heads`). Returns `[n, n_heads * head_dim_v]`
/// (f32), or `Ok(None)` when a tensor is not on the CPU (compute it densely
/// instead). A row that sees no cell gets zeros.
///
/// Only the cells the rows see are read, in their stored type.
///
/// The kernel, FlashAttention-2 style:
/// - Rows are grouped into *blocks* of up to 16 consecutive rows whose first
///   runs start at the same cell (a prefill chunk of one sequence, or decode
///   rows of sequences sharing a prefix through `copy_prefix`); every other
///   decode row is a block of its own. The grouping only decides what is read
///   once for several rows: each row still attends to its own cells.
/// - A work item is a block and one key/value head; items are spread over
///   candle's thread pool. An item walks the union of its rows' runs in tiles
///   of up to 64 cells: it gathers that head's keys (transposed, `[head_dim][64]`)
///   and values (`[64][head_dim_v]`) of the tile's cells into small f32 buffers,
///   decoding as it reads, and gives each row a 64-bit mask of the tile entries
///   it sees (its runs merged against the tile's cells).
/// - Per row, query heads two at a time (the pair shares every key and value
///   load, and its two chains of multiply-adds keep the FMA units busy),
///   scores are `s[0..64] += q[d] * kᵀ[d][0..64]` (no horizontal sum) when
///   many queries share the tile (a prefill block); when few do (a decode
///   row's query heads) the keys stay row-major and each score is a dot
///   product, eight cells at a time, sparing the transposition. Keys and
///   values stored as f32 rows are read in place. Then scaled, hidden entries
///   `-inf`; a running maximum, sum and accumulator are rescaled as the
///   maximum grows, the accumulator takes `p * v[c]` for each visible cell
///   `c` (64 dimensions at a time held in registers), and the end divides by
///   the sum.
///
/// Cost: per key/value head, the cells of each block's union are read once
/// and decoded once, and each row pays `g * (head_dim + head_dim_v)` multiply-adds
/// per cell of the tiles it touches, about what it sees: the pass's range and
/// other sequences' cells are never read. The inner loops are plain arithmetic
/// compiled three times, chosen at run time: for AVX-512 and for AVX2, both
/// with fused multiply-adds (the same results, bit for bit; one loop the
/// compiler left in memory is written with AVX-512 intrinsics), and portably
/// with separate multiplies and adds, as `crate::kernels` does.
///
/// # Errors
/// [`ModelError::InvalidArgument`](crate::ModelError::InvalidArgument) when the shapes or types do not fit
/// (`n != view.runs.rows()`, head counts or dimensions that disagree, a run
/// past the stored cells, queries not f32).
pub fn paged_attention(q: &Tensor, view: &PagedKv<'_, Tensor>, scale: f32) -> Result<Option<Tensor>> {
    if !all_on(q, view, Device::is_cpu) {
        return Ok(None);
    }
    let geometry = Geometry::of(q, view)?;
    let Geometry {
        n,
        n_heads,
        kv_heads: kvh,
        group: g,
        head_dim: hd,
        head_dim_v: hdv,
        ..
    } = geometry;
    let runs = view.runs;
    let k_held = Held::new(&view.keys);
    let v_held = Held::new(&view.values);
    let Some(keys) = k_held.plane(&geometry.keys)? else {
        return Ok(None);
    };
    let Some(values) = v_held.plane(&geometry.values)? else {
        return Ok(None);
    };
    let q = q.contiguous()?;
    let q_held = q.storage_and_layout();
    let Storage::Cpu(q_cpu) = &*q_held.0 else {
        return Ok(None);
    };
    let qs = &q_cpu.as_slice::<f32>()?[q_held.1.start_offset()..][..n * n_heads * hd];

    let blocks = blocks(runs);
    let mut out = vec![0f32; n * n_heads * hdv];
    {
        // Each (row, key/value head) owns `g * hdv` consecutive outputs, written
        // by the one item that holds the row's block and that head.
        let slots: Vec<Mutex<&mut [f32]>> = out.chunks_mut(g * hdv).map(Mutex::new).collect();
        let job = Job {
            q: qs,
            n_heads,
            kvh,
            g,
            hd,
            hdv,
            scale,
            keys,
            values,
            runs,
            blocks: &blocks,
            out: &slots,
        };
        let macs = runs.total_visible() * n_heads * (hd + hdv);
        // About eight multiply-adds a vector instruction: the element-wise work
        // the pool's threshold is measured in.
        kernels::for_items(blocks.len() * kvh, macs / 8, |item| run_item(&job, item));
    }
    Ok(Some(Tensor::from_vec(out, (n, n_heads * hdv), q.device())?))
}

/// Consecutive rows attended together: they share the tiles of `union`.
#[derive(Debug)]
struct Block {
    rows: Range<usize>,
    /// Every cell any of the rows sees, as sorted disjoint runs.
    union: Vec<CellRun>,
}

/// Groups the rows into [`Block`]s: a row joins the current block when its
/// first run starts where the block's first row's does, up to [`BLOCK_ROWS`].
fn blocks(runs: &RowRuns) -> Vec<Block> {
    let n = runs.rows();
    let first = |r: usize| runs.row(r).first().map(|c| c.start);
    let mut blocks = Vec::new();
    let mut all = Vec::new();
    let mut r = 0;
    while r < n {
        let key = first(r);
        let mut end = r + 1;
        while end < n && end - r < BLOCK_ROWS && first(end) == key {
            end += 1;
        }
        all.clear();
        for row in r..end {
            all.extend_from_slice(runs.row(row));
        }
        all.sort_unstable_by_key(|c| c.start);
        let mut union: Vec<CellRun> = Vec::new();
        for &run in &all {
            match union.last_mut() {
                Some(last) if run.start <= last.end => last.end = last.end.max(run.end),
                _ => union.push(run),
            }
        }
        blocks.push(Block { rows: r..end, union });
        r = end;
    }
    blocks
}

/// A stored tensor's storage, borrowed while the kernel reads it.
struct Held<'t> {
    data: StorageRef<'t>,
    scales: Option<StorageRef<'t>>,
}

impl<'t> Held<'t> {
    fn new(stored: &'t StoredKv<Tensor>) -> Self {
        let hold = |t: &'t Tensor| t.storage_and_layout().0;
        match stored {
            StoredKv::Float(t) => Held {
                data: hold(t),
                scales: None,
            },
            StoredKv::Q8_0 { quants, scales } => Held {
                data: hold(quants),
                scales: Some(hold(scales)),
            },
        }
    }

    /// The stored elements of `shape` as a [`Plane`]; `None` off the CPU.
    fn plane(&self, shape: &StoredShape) -> Result<Option<Plane<'_>>> {
        let Storage::Cpu(cpu) = &*self.data else {
            return Ok(None);
        };
        let scales = match &self.scales {
            Some(held) => match &**held {
                Storage::Cpu(s) => Some(s.as_slice::<f16>()?),
                _ => return Ok(None),
            },
            None => None,
        };
        let (data, len) = match (shape.ty, shape.scales_at, scales) {
            (StoredType::F32, ..) => {
                let s = cpu.as_slice::<f32>()?;
                (Data::F32(s), s.len())
            }
            (StoredType::F16, ..) => {
                let s = cpu.as_slice::<f16>()?;
                (Data::F16(s), s.len())
            }
            (StoredType::BF16, ..) => {
                let s = cpu.as_slice::<bf16>()?;
                (Data::BF16(s), s.len())
            }
            (StoredType::Q8_0, Some(scales_at), Some(scales)) => {
                let quants = cpu.as_slice::<u8>()?;
                (
                    Data::Q8 {
                        quants,
                        scales,
                        scales_at,
                    },
                    quants.len(),
                )
            }
            (StoredType::Q8_0, ..) => unreachable!("StoredShape::of gives q8_0 scales"),
        };
        shape.check_within(len, scales.map_or(0, <[f16]>::len))?;
        Ok(Some(Plane {
            data,
            at: shape.at,
            dim: shape.dim,
        }))
    }
}

/// Stored elements, in their type.
#[derive(Debug, Clone, Copy)]
enum Data<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
    /// `q + 128` and one scale per 32 values along the head dimension.
    Q8 {
        quants: &'a [u8],
        scales: &'a [f16],
        scales_at: Strides,
    },
}

/// One layer's keys or values as stored, logical `[cells, heads, dim]`.
#[derive(Debug, Clone, Copy)]
struct Plane<'a> {
    data: Data<'a>,
    at: Strides,
    dim: usize,
}

/// Conversion of a stored float element to f32.
trait Element: Copy {
    /// `dst[i] = src[i]` as f32 (same lengths).
    fn to_f32s(src: &[Self], dst: &mut [f32]);
    fn to_f32(self) -> f32;
    /// `dst[d * step] = src[d]` as f32 for every `d`; `row` is scratch of
    /// `src.len()` floats.
    #[inline(always)]
    fn scatter(src: &[Self], dst: &mut [f32], step: usize, row: &mut [f32]) {
        Self::to_f32s(src, row);
        for (d, &x) in row.iter().enumerate() {
            dst[d * step] = x;
        }
    }
}

impl Element for f32 {
    #[inline(always)]
    fn to_f32s(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn scatter(src: &[f32], dst: &mut [f32], step: usize, _row: &mut [f32]) {
        for (d, &x) in src.iter().enumerate() {
            dst[d * step] = x;
        }
    }
}

impl Element for f16 {
    #[inline(always)]
    fn to_f32s(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl Element for bf16 {
    #[inline(always)]
    fn to_f32s(src: &[bf16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

impl<'a> Plane<'a> {
    /// The stored elements, when they are f32 and each cell's head is one
    /// contiguous row (`(cell, head, 0..dim)` at `at.at(cell, head, 0)..`):
    /// read in place, with no copy.
    fn f32_rows(&self) -> Option<&'a [f32]> {
        match self.data {
            Data::F32(s) if self.at.dim == 1 => Some(s),
            _ => None,
        }
    }

    /// Writes element `(cells[k], head, d)` as f32 to `dst[k * cell_step + d *
    /// dim_step]` for every tile entry `k` and `d < dim`; `row` is scratch of
    /// at least `dim` floats.
    #[inline(always)]
    fn gather(&self, head: usize, cells: &[u32], dst: &mut [f32], step: (usize, usize), row: &mut [f32]) {
        match self.data {
            Data::F32(s) => self.gather_float(s, head, cells, dst, step, row),
            Data::F16(s) => self.gather_float(s, head, cells, dst, step, row),
            Data::BF16(s) => self.gather_float(s, head, cells, dst, step, row),
            Data::Q8 {
                quants,
                scales,
                scales_at,
            } => self.gather_q8(quants, scales, scales_at, head, cells, dst, step, row),
        }
    }

    #[inline(always)]
    fn gather_float<E: Element>(
        &self,
        s: &[E],
        head: usize,
        cells: &[u32],
        dst: &mut [f32],
        (cell_step, dim_step): (usize, usize),
        row: &mut [f32],
    ) {
        let (at, dim) = (self.at, self.dim);
        if at.dim == 1 {
            // A cell's head is one contiguous row: convert it whole.
            let row = &mut row[..dim];
            for (k, &c) in cells.iter().enumerate() {
                let start = at.at(c as usize, head, 0);
                // The next tile's rows, if its cells follow these.
                prefetch(s.as_ptr().wrapping_add(start + TILE * at.cell), dim);
                let src = &s[start..start + dim];
                if dim_step == 1 {
                    E::to_f32s(src, &mut dst[k * cell_step..k * cell_step + dim]);
                } else {
                    E::scatter(src, &mut dst[k * cell_step..], dim_step, row);
                }
            }
        } else {
            // Permuted: consecutive cells of one dimension lie side by side.
            for d in 0..dim {
                let base = at.at(0, head, d);
                for (k, &c) in cells.iter().enumerate() {
                    dst[k * cell_step + d * dim_step] = s[base + c as usize * at.cell].to_f32();
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn gather_q8(
        &self,
        quants: &[u8],
        scales: &[f16],
        scales_at: Strides,
        head: usize,
        cells: &[u32],
        dst: &mut [f32],
        (cell_step, dim_step): (usize, usize),
        row: &mut [f32],
    ) {
        let (at, dim) = (self.at, self.dim);
        let decode = |q: u8, d: f32| (f32::from(q) - 128.0) * d;
        if at.dim == 1 {
            let row = &mut row[..dim];
            for (k, &c) in cells.iter().enumerate() {
                let c = c as usize;
                let start = at.at(c, head, 0);
                // The next tile's rows, if its cells follow these.
                prefetch(quants.as_ptr().wrapping_add(start + TILE * at.cell), dim);
                let qs = &quants[start..start + dim];
                for (b, (out, q)) in row.chunks_exact_mut(32).zip(qs.chunks_exact(32)).enumerate() {
                    let d = scales[scales_at.at(c, head, b)].to_f32();
                    for (o, &q) in out.iter_mut().zip(q) {
                        *o = decode(q, d);
                    }
                }
                if dim_step == 1 {
                    dst[k * cell_step..k * cell_step + dim].copy_from_slice(row);
                } else {
                    for (d, &x) in row.iter().enumerate() {
                        dst[k * cell_step + d * dim_step] = x;
                    }
                }
            }
        } else {
            for d in 0..dim {
                let base = at.at(0, head, d);
                let s_base = scales_at.at(0, head, d / 32);
                for (k, &c) in cells.iter().enumerate() {
                    let c = c as usize;
                    let scale = scales[s_base + c * scales_at.cell].to_f32();
                    dst[k * cell_step + d * dim_step] = decode(quants[base + c * at.cell], scale);
                }
            }
        }
    }
}

/// Asks the CPU to start loading the `len` elements from `ptr` (a hint: any
/// address, none read).
#[inline(always)]
fn prefetch<E>(ptr: *const E, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let bytes = len * std::mem::size_of::<E>();
        for line in (0..bytes).step_by(64) {
            // SAFETY: a prefetch never faults, whatever the address (SSE,
            // which every x86_64 CPU has), and `wrapping_byte_add` makes no
            // in-bounds promise.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(ptr.wrapping_byte_add(line).cast()) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (ptr, len);
}

/// Everything the work items share.
struct Job<'a> {
    /// Queries, `[n, n_heads, hd]` row-major.
    q: &'a [f32],
    n_heads: usize,
    kvh: usize,
    g: usize,
    hd: usize,
    hdv: usize,
    scale: f32,
    keys: Plane<'a>,
    values: Plane<'a>,
    runs: &'a RowRuns,
    blocks: &'a [Block],
    /// Row `r`'s outputs for key/value head `j` at `out[r * kvh + j]`.
    out: &'a [Mutex<&'a mut [f32]>],
}

/// A work item's buffers, kept by each thread between items and calls (a
/// fresh allocation per item cost page faults).
#[derive(Debug, Default)]
struct Scratch {
    /// Keys of a tile: transposed, `[hd][TILE]`, or as stored, `[TILE][hd]`
    /// (few queries, [`DOT_QUERIES`]).
    kt: Vec<f32>,
    /// Values of a tile, `[TILE][hdv]`.
    vt: Vec<f32>,
    /// One stored row converted.
    row: Vec<f32>,
    /// Per row and query head of the block: the running output, maximum and sum.
    acc: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
    /// Per row of the block: its first run that may still meet a tile.
    cursor: Vec<usize>,
    /// The tile's segments: (first entry, first cell, end cell).
    segments: Vec<(usize, u32, u32)>,
}

/// `v` as `len` copies of `value`, keeping its allocation.
fn reset<T: Copy>(v: &mut Vec<T>, len: usize, value: T) {
    v.clear();
    v.resize(len, value);
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// Work item `item` (block `item / kvh`, key/value head `item % kvh`), through
/// the widest instructions the CPU has.
fn run_item(job: &Job<'_>, item: usize) {
    SCRATCH.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        #[cfg(target_arch = "x86_64")]
        if kernels::has_avx2_fma() {
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F, AVX2 and FMA, all that
                // `run_item_avx512` needs.
                unsafe { run_item_avx512(job, item, &mut scratch) };
            } else {
                // SAFETY: the CPU has AVX2 and FMA, all that `run_item_avx2` needs.
                unsafe { run_item_avx2(job, item, &mut scratch) };
            }
            return;
        }
        run_item_generic::<false, false>(job, item, &mut scratch);
    });
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_item_avx2(job: &Job<'_>, item: usize, scratch: &mut Scratch) {
    run_item_generic::<true, false>(job, item, scratch);
}

/// The same arithmetic as [`run_item_avx2`] (same results, bit for bit), in
/// 512-bit registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn run_item_avx512(job: &Job<'_>, item: usize, scratch: &mut Scratch) {
    run_item_generic::<true, true>(job, item, scratch);
}

/// `a * b + c`, rounded once where the CPU fuses it (`FUSED`: compiled for
/// FMA, one instruction), else twice.
#[inline(always)]
fn mul_add<const FUSED: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FUSED {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// Lanes of the reductions (see [`kernels`]): independent partial results the
/// compiler keeps in one vector register.
const LANES: usize = 8;

/// `q . rows[j]` for each of the `N` rows (each as long as `q`), each in
/// [`LANES`] partial sums: `N` independent chains of multiply-adds, enough to
/// keep the FMA units busy where one dot product waits on its own latency.
#[inline(always)]
fn dots<const FUSED: bool, const N: usize>(q: &[f32], rows: [&[f32]; N]) -> [f32; N] {
    let mut lanes = [[0f32; LANES]; N];
    let whole = q.len() / LANES * LANES;
    for c in (0..whole).step_by(LANES) {
        let qc: &[f32; LANES] = q[c..c + LANES].try_into().expect("a chunk");
        for (lane, row) in lanes.iter_mut().zip(&rows) {
            let kc: &[f32; LANES] = row[c..c + LANES].try_into().expect("a chunk");
            for l in 0..LANES {
                lane[l] = mul_add::<FUSED>(qc[l], kc[l], lane[l]);
            }
        }
    }
    let mut out = [0f32; N];
    #[cfg(target_arch = "x86_64")]
    if FUSED && N == 8 {
        // SAFETY: `FUSED` is set only in the AVX2 and AVX-512 paths, which
        // run where the CPU has AVX; `lanes` holds eight arrays of LANES.
        let sums = unsafe { lane_sums8(lanes.as_ptr().cast()) };
        out.copy_from_slice(&sums[..N]);
    } else {
        for (o, lane) in out.iter_mut().zip(&lanes) {
            *o = lane_sum(lane);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    for (o, lane) in out.iter_mut().zip(&lanes) {
        *o = lane_sum(lane);
    }
    if whole < q.len() {
        for (o, row) in out.iter_mut().zip(&rows) {
            let tail: f32 = q[whole..].iter().zip(&row[whole..]).map(|(x, y)| x * y).sum();
            *o += tail;
        }
    }
    out
}

/// The sum of one dot product's lanes, pairwise: `((l0 + l1) + (l2 + l3)) +
/// ((l4 + l5) + (l6 + l7))`, the order [`lane_sums8`] takes for eight at once,
/// so that a score is the same bits whichever of the two computed it.
#[inline(always)]
fn lane_sum(l: &[f32; LANES]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// [`lane_sum`] of eight lane arrays (`[[f32; 8]; 8]` at `lanes`) at once,
/// with horizontal adds and one exchange of halves: a few instructions for
/// eight sums instead of a chain of scalar adds for each.
///
/// # Safety
/// Needs AVX; `lanes` must point to 64 readable floats.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx")]
unsafe fn lane_sums8(lanes: *const f32) -> [f32; 8] {
    use std::arch::x86_64::*;
    // SAFETY: the caller guarantees 64 readable floats.
    unsafe {
        let a = |j: usize| _mm256_loadu_ps(lanes.add(8 * j));
        // Lanes of b0: a0's (0+1), (2+3), a1's (0+1), (2+3) | a0's (4+5), (6+7), a1's ...
        let b0 = _mm256_hadd_ps(a(0), a(1));
        let b1 = _mm256_hadd_ps(a(2), a(3));
        let b2 = _mm256_hadd_ps(a(4), a(5));
        let b3 = _mm256_hadd_ps(a(6), a(7));
        // Lanes of c0: a0..a3's ((0+1)+(2+3)) | a0..a3's ((4+5)+(6+7)).
        let c0 = _mm256_hadd_ps(b0, b1);
        let c1 = _mm256_hadd_ps(b2, b3);
        let lo = _mm256_permute2f128_ps::<0x20>(c0, c1);
        let hi = _mm256_permute2f128_ps::<0x31>(c0, c1);
        let mut out = [0f32; 8];
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(lo, hi));
        out
    }
}

/// Scores of one query against a tile of transposed keys (`[hd][TILE]`):
/// `s[l] = sum_d q[d] * kt[d][l]`, each in order of `d`. The sums live in a
/// local array indexed by constants only, which the compiler keeps in
/// registers (indexed from outside, the array went through memory each step).
#[inline(always)]
fn scores_transposed<const FUSED: bool>(q: &[f32], kt: &[f32]) -> [f32; TILE] {
    let mut s = [0f32; TILE];
    let (rows, _) = kt.as_chunks::<TILE>();
    for (&qd, k) in q.iter().zip(rows) {
        for l in 0..TILE {
            s[l] = mul_add::<FUSED>(qd, k[l], s[l]);
        }
    }
    s
}

/// Scores of two queries against a tile of transposed keys, as
/// [`scores_transposed`] gives each.
#[inline(always)]
fn scores_transposed2<const FUSED: bool>(q0: &[f32], q1: &[f32], kt: &[f32]) -> ([f32; TILE], [f32; TILE]) {
    let (mut s0, mut s1) = ([0f32; TILE], [0f32; TILE]);
    // Whole tile rows, so that no bounds check (a panic path) sits in the loop
    // and the sums stay in registers from one dimension to the next.
    let (rows, _) = kt.as_chunks::<TILE>();
    for ((&a, &b), k) in q0.iter().zip(q1).zip(rows) {
        for l in 0..TILE {
            s0[l] = mul_add::<FUSED>(a, k[l], s0[l]);
            s1[l] = mul_add::<FUSED>(b, k[l], s1[l]);
        }
    }
    (s0, s1)
}

/// [`scores_transposed2`] (fused), its sums held in registers by hand: the
/// compiler kept the generic version's two arrays in memory.
///
/// # Safety
/// Needs AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn scores_transposed2_avx512(q0: &[f32], q1: &[f32], kt: &[f32]) -> ([f32; TILE], [f32; TILE]) {
    use std::arch::x86_64::*;
    const V: usize = TILE / 16;
    let (rows, _) = kt.as_chunks::<TILE>();
    let mut a = [_mm512_setzero_ps(); V];
    let mut b = [_mm512_setzero_ps(); V];
    for ((&x, &y), k) in q0.iter().zip(q1).zip(rows) {
        let (x, y) = (_mm512_set1_ps(x), _mm512_set1_ps(y));
        for c in 0..V {
            // SAFETY: `k` holds TILE = 16 * V floats.
            let kc = unsafe { _mm512_loadu_ps(k.as_ptr().add(16 * c)) };
            a[c] = _mm512_fmadd_ps(x, kc, a[c]);
            b[c] = _mm512_fmadd_ps(y, kc, b[c]);
        }
    }
    let (mut s0, mut s1) = ([0f32; TILE], [0f32; TILE]);
    for c in 0..V {
        // SAFETY: each array holds TILE = 16 * V floats.
        unsafe {
            _mm512_storeu_ps(s0.as_mut_ptr().add(16 * c), a[c]);
            _mm512_storeu_ps(s1.as_mut_ptr().add(16 * c), b[c]);
        }
    }
    (s0, s1)
}

/// Writes the `t` rows of `dim` floats that start at `src[start(k)]` as
/// columns of `dst` (`[dim][TILE]`: `dst[d * TILE + k] = src[start(k) + d]`),
/// eight rows by eight dimensions at a time through registers (the element by
/// element scatter took a third of the kernel's time on long prefills).
///
/// # Safety
/// Needs AVX. Every `start(k) + dim` for `k < t` must lie within `src`, `t <=
/// TILE` and `dst` must hold `dim * TILE` floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn transpose_rows(src: &[f32], start: impl Fn(usize) -> usize, t: usize, dim: usize, dst: &mut [f32]) {
    use std::arch::x86_64::*;
    assert!(t <= TILE && dst.len() >= dim * TILE);
    let starts: [usize; TILE] = std::array::from_fn(|k| if k < t { start(k) } else { 0 });
    for &at in &starts[..t] {
        assert!(at + dim <= src.len(), "a key row past the stored keys");
    }
    let (full_k, full_d) = (t / 8 * 8, dim / 8 * 8);
    for k0 in (0..full_k).step_by(8) {
        for d0 in (0..full_d).step_by(8) {
            // SAFETY: rows `k0..k0 + 8` hold `d0 + 8 <= dim` floats from their
            // start (asserted above); `dst` rows `d0..d0 + 8` hold columns
            // `k0..k0 + 8 <= TILE`.
            unsafe {
                let row = |j: usize| _mm256_loadu_ps(src.as_ptr().add(starts[k0 + j] + d0));
                let (r0, r1, r2, r3) = (row(0), row(1), row(2), row(3));
                let (r4, r5, r6, r7) = (row(4), row(5), row(6), row(7));
                let (t0, t1) = (_mm256_unpacklo_ps(r0, r1), _mm256_unpackhi_ps(r0, r1));
                let (t2, t3) = (_mm256_unpacklo_ps(r2, r3), _mm256_unpackhi_ps(r2, r3));
                let (t4, t5) = (_mm256_unpacklo_ps(r4, r5), _mm256_unpackhi_ps(r4, r5));
                let (t6, t7) = (_mm256_unpacklo_ps(r6, r7), _mm256_unpackhi_ps(r6, r7));
                let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
                let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
                let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
                let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
                let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
                let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
                let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
                let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
                let out = [
                    _mm256_permute2f128_ps::<0x20>(s0, s4),
                    _mm256_permute2f128_ps::<0x20>(s1, s5),
                    _mm256_permute2f128_ps::<0x20>(s2, s6),
                    _mm256_permute2f128_ps::<0x20>(s3, s7),
                    _mm256_permute2f128_ps::<0x31>(s0, s4),
                    _mm256_permute2f128_ps::<0x31>(s1, s5),
                    _mm256_permute2f128_ps::<0x31>(s2, s6),
                    _mm256_permute2f128_ps::<0x31>(s3, s7),
                ];
                for (j, v) in out.into_iter().enumerate() {
                    _mm256_storeu_ps(dst.as_mut_ptr().add((d0 + j) * TILE + k0), v);
                }
            }
        }
    }
    // What the blocks of eight left: the last dimensions of the whole rows,
    // then the last rows.
    for (k, &at) in starts[..full_k].iter().enumerate() {
        for d in full_d..dim {
            dst[d * TILE + k] = src[at + d];
        }
    }
    for (k, &at) in starts.iter().enumerate().take(t).skip(full_k) {
        for d in 0..dim {
            dst[d * TILE + k] = src[at + d];
        }
    }
}

/// Scores of one query against the tile's first `t` keys as stored rows
/// (`key(k)`), eight at a time; entries past `t` are 0 (hidden by every mask).
#[inline(always)]
fn scores_dot<'k, const FUSED: bool>(q: &[f32], t: usize, key: impl Fn(usize) -> &'k [f32]) -> [f32; TILE] {
    let mut s = [0f32; TILE];
    let mut k = 0;
    while k + 8 <= t {
        let rows = std::array::from_fn(|j| key(k + j));
        s[k..k + 8].copy_from_slice(&dots::<FUSED, 8>(q, rows));
        k += 8;
    }
    while k < t {
        s[k] = dots::<FUSED, 1>(q, [key(k)])[0];
        k += 1;
    }
    s
}

/// Turns one query's scaled scores into probabilities under the running
/// maximum (`bias`: 0 where the row sees the entry, `-inf` elsewhere), adds
/// them to the running `sum`, and rescales the running output `acc` when the
/// maximum grows.
#[inline(always)]
fn softmax_tile(
    s: &mut [f32; TILE],
    bias: &[f32; TILE],
    scale: f32,
    max: &mut f32,
    sum: &mut f32,
    acc: &mut [f32],
) {
    let mut lane_max = [f32::NEG_INFINITY; LANES];
    for (sc, bc) in s.chunks_exact_mut(LANES).zip(bias.chunks_exact(LANES)) {
        for l in 0..LANES {
            sc[l] = sc[l] * scale + bc[l];
            lane_max[l] = if sc[l] > lane_max[l] { sc[l] } else { lane_max[l] };
        }
    }
    let tile_max = lane_max.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let new_max = max.max(tile_max);
    let mut lane_sum = [0f32; LANES];
    for sc in s.chunks_exact_mut(LANES) {
        for l in 0..LANES {
            sc[l] = kernels::exp(sc[l] - new_max);
            lane_sum[l] += sc[l];
        }
    }
    let tile_sum: f32 = lane_sum.iter().sum();
    if new_max > *max {
        // The running maximum grew: rescale what was summed under it.
        let factor = kernels::exp(*max - new_max);
        *sum *= factor;
        for x in acc.iter_mut() {
            *x *= factor;
        }
        *max = new_max;
    }
    *sum += tile_sum;
}

/// `acc += p[k] * v[k]` for every tile entry `k` in `mask`, value row `k` at
/// `values[at[k]..]`, cell after cell. Each [`PV_CHUNK`] of the output stays
/// in registers while every visible cell adds to it.
#[inline(always)]
fn accumulate_values<const FUSED: bool>(
    acc: &mut [f32],
    p: &[f32; TILE],
    mask: u64,
    values: &[f32],
    at: &[usize; TILE],
) {
    for (chunk, out) in acc.chunks_mut(PV_CHUNK).enumerate() {
        let from = chunk * PV_CHUNK;
        let len = out.len();
        let mut bits = mask;
        if let Ok(out) = <&mut [f32; PV_CHUNK]>::try_from(&mut *out) {
            let mut local = *out;
            while bits != 0 {
                let k = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                let v: &[f32; PV_CHUNK] = values[at[k] + from..][..PV_CHUNK].try_into().expect("a chunk");
                for x in 0..PV_CHUNK {
                    local[x] = mul_add::<FUSED>(p[k], v[x], local[x]);
                }
            }
            *out = local;
        } else {
            while bits != 0 {
                let k = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                for (x, &v) in out.iter_mut().zip(&values[at[k] + from..][..len]) {
                    *x = mul_add::<FUSED>(p[k], v, *x);
                }
            }
        }
    }
}

/// [`accumulate_values`] for two queries of one row (the same mask): each
/// value row is loaded once for both, and each output gets the same steps
/// in the same order as alone.
#[inline(always)]
fn accumulate_values2<const FUSED: bool>(
    acc0: &mut [f32],
    acc1: &mut [f32],
    p0: &[f32; TILE],
    p1: &[f32; TILE],
    mask: u64,
    values: &[f32],
    at: &[usize; TILE],
) {
    for (chunk, (out0, out1)) in acc0
        .chunks_mut(PV_CHUNK)
        .zip(acc1.chunks_mut(PV_CHUNK))
        .enumerate()
    {
        let from = chunk * PV_CHUNK;
        let len = out0.len();
        let mut bits = mask;
        match (
            <&mut [f32; PV_CHUNK]>::try_from(&mut *out0),
            <&mut [f32; PV_CHUNK]>::try_from(&mut *out1),
        ) {
            (Ok(out0), Ok(out1)) => {
                let (mut l0, mut l1) = (*out0, *out1);
                while bits != 0 {
                    let k = bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    let v: &[f32; PV_CHUNK] = values[at[k] + from..][..PV_CHUNK].try_into().expect("a chunk");
                    for x in 0..PV_CHUNK {
                        l0[x] = mul_add::<FUSED>(p0[k], v[x], l0[x]);
                        l1[x] = mul_add::<FUSED>(p1[k], v[x], l1[x]);
                    }
                }
                *out0 = l0;
                *out1 = l1;
            }
            _ => {
                while bits != 0 {
                    let k = bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    let v = &values[at[k] + from..][..len];
                    for ((x0, x1), &v) in out0.iter_mut().zip(out1.iter_mut()).zip(v) {
                        *x0 = mul_add::<FUSED>(p0[k], v, *x0);
                        *x1 = mul_add::<FUSED>(p1[k], v, *x1);
                    }
                }
            }
        }
    }
}

/// Values accumulated per chunk of this many dimensions, the chunk held in
/// registers while every visible cell of the tile adds to it.
const PV_CHUNK: usize = 64;

/// `bits` set from `from` for `len` bits (`len >= 1`, `from + len <= 64`).
#[inline(always)]
fn bit_range(from: usize, len: usize) -> u64 {
    let ones = if len >= 64 { u64::MAX } else { (1u64 << len) - 1 };
    ones << from
}

/// The tile entries a row sees: its runs (from `cursor` on, which moves past
/// runs that end before the tile) against the tile's segments `(entry,
/// first cell, end cell)`.
#[inline(always)]
fn row_mask(row: &[CellRun], cursor: &mut usize, segments: &[(usize, u32, u32)]) -> u64 {
    let mut mask = 0u64;
    for &(entry, a, b) in segments {
        while *cursor < row.len() && row[*cursor].end <= a {
            *cursor += 1;
        }
        let mut i = *cursor;
        while i < row.len() && row[i].start < b {
            let (lo, hi) = (row[i].start.max(a), row[i].end.min(b));
            mask |= bit_range(entry + (lo - a) as usize, (hi - lo) as usize);
            i += 1;
        }
    }
    mask
}

#[inline(always)]
fn run_item_generic<const FUSED: bool, const AVX512: bool>(
    job: &Job<'_>,
    item: usize,
    scratch: &mut Scratch,
) {
    let (block, head) = (&job.blocks[item / job.kvh], item % job.kvh);
    let (g, hd, hdv) = (job.g, job.hd, job.hdv);
    let rows = block.rows.clone();
    let nr = rows.len();
    let Scratch {
        kt,
        vt,
        row: row_buf,
        acc,
        max,
        sum,
        cursor,
        segments,
    } = scratch;
    reset(kt, hd * TILE, 0.0);
    reset(vt, TILE * hdv, 0.0);
    reset(row_buf, hd.max(hdv), 0.0);
    reset(acc, nr * g * hdv, 0.0);
    reset(max, nr * g, f32::NEG_INFINITY);
    reset(sum, nr * g, 0.0);
    reset(cursor, nr, 0);
    let mut cells = [0u32; TILE];
    let transposed = nr * g > DOT_QUERIES;
    // Keys (dot products) and values read in place where they are stored as
    // f32 rows; otherwise converted into the tile buffers.
    let keys_in_place = if transposed { None } else { job.keys.f32_rows() };
    let values_in_place = job.values.f32_rows();
    let mut key_at = [0usize; TILE];
    let mut value_at = [0usize; TILE];
    let union = &block.union;
    let (mut ui, mut next) = (0, union.first().map_or(0, |r| r.start));
    loop {
        // The next tile: up to TILE cells of the union, as segments of runs.
        segments.clear();
        let mut t = 0;
        while t < TILE && ui < union.len() {
            let take = ((union[ui].end - next) as usize).min(TILE - t);
            segments.push((t, next, next + take as u32));
            for (k, c) in (next..next + take as u32).enumerate() {
                cells[t + k] = c;
            }
            t += take;
            next += take as u32;
            if next == union[ui].end {
                ui += 1;
                if let Some(r) = union.get(ui) {
                    next = r.start;
                }
            }
        }
        if t == 0 {
            break;
        }
        let tile = &cells[..t];
        let keys: &[f32] = match keys_in_place {
            Some(stored) => {
                for (at, &c) in key_at.iter_mut().zip(tile) {
                    *at = job.keys.at.at(c as usize, head, 0);
                }
                stored
            }
            None if !transposed => {
                job.keys.gather(head, tile, kt, (hd, 1), row_buf);
                for (k, at) in key_at.iter_mut().enumerate() {
                    *at = k * hd;
                }
                kt
            }
            None => {
                if t < TILE {
                    // Entries past the tile are hidden from every row: zero keys
                    // keep their scores finite (then -inf).
                    for d in 0..hd {
                        kt[d * TILE + t..(d + 1) * TILE].fill(0.0);
                    }
                }
                match job.keys.f32_rows() {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `FUSED` is set only in the AVX2 and AVX-512
                    // paths, which run where the CPU has AVX.
                    Some(stored) if FUSED => unsafe {
                        transpose_rows(stored, |k| job.keys.at.at(tile[k] as usize, head, 0), t, hd, kt)
                    },
                    _ => job.keys.gather(head, tile, kt, (1, TILE), row_buf),
                }
                kt
            }
        };
        let values: &[f32] = match values_in_place {
            Some(stored) => {
                for (at, &c) in value_at.iter_mut().zip(tile) {
                    *at = job.values.at.at(c as usize, head, 0);
                }
                stored
            }
            None => {
                job.values.gather(head, tile, vt, (hdv, 1), row_buf);
                for (k, at) in value_at.iter_mut().enumerate() {
                    *at = k * hdv;
                }
                vt
            }
        };
        let key = |k: usize| &keys[key_at[k]..key_at[k] + hd];
        for (ri, r) in rows.clone().enumerate() {
            let mask = row_mask(job.runs.row(r), &mut cursor[ri], segments);
            if mask == 0 {
                continue;
            }
            let mut bias = [0f32; TILE];
            for (k, b) in bias.iter_mut().enumerate() {
                *b = if mask >> k & 1 != 0 {
                    0.0
                } else {
                    f32::NEG_INFINITY
                };
            }
            // Query heads two at a time: the pair shares every key and value
            // it loads, and its two chains of multiply-adds keep the FMA
            // units busy where one chain would wait on its own latency.
            let mut i = 0;
            while i < g {
                let pair = i + 1 < g;
                let query = |i: usize| &job.q[(r * job.n_heads + head * g + i) * hd..][..hd];
                let (q0, q1) = (query(i), query(if pair { i + 1 } else { i }));
                let (mut s0, mut s1) = match (transposed, pair) {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `AVX512` is set only in `run_item_avx512`, which
                    // runs where the CPU has AVX-512F.
                    (true, true) if AVX512 => unsafe { scores_transposed2_avx512(q0, q1, keys) },
                    (true, true) => scores_transposed2::<FUSED>(q0, q1, keys),
                    (true, false) => (scores_transposed::<FUSED>(q0, keys), [0f32; TILE]),
                    (false, _) => {
                        let s1 = if pair {
                            scores_dot::<FUSED>(q1, t, key)
                        } else {
                            [0f32; TILE]
                        };
                        (scores_dot::<FUSED>(q0, t, key), s1)
                    }
                };
                let idx = ri * g + i;
                let both = &mut acc[idx * hdv..(idx + if pair { 2 } else { 1 }) * hdv];
                let (a0, a1) = both.split_at_mut(hdv);
                softmax_tile(&mut s0, &bias, job.scale, &mut max[idx], &mut sum[idx], a0);
                if pair {
                    softmax_tile(
                        &mut s1,
                        &bias,
                        job.scale,
                        &mut max[idx + 1],
                        &mut sum[idx + 1],
                        a1,
                    );
                    accumulate_values2::<FUSED>(a0, a1, &s0, &s1, mask, values, &value_at);
                } else {
                    accumulate_values::<FUSED>(a0, &s0, mask, values, &value_at);
                }
                i += if pair { 2 } else { 1 };
            }
        }
    }
    for (ri, r) in rows.enumerate() {
        let mut slot = job.out[r * job.kvh + head]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        for i in 0..g {
            let idx = ri * g + i;
            // A row that saw nothing keeps its zeros.
            let inv = if sum[idx] > 0.0 { 1.0 / sum[idx] } else { 0.0 };
            for (o, &x) in slot[i * hdv..(i + 1) * hdv]
                .iter_mut()
                .zip(&acc[idx * hdv..(idx + 1) * hdv])
            {
                *o = x * inv;
            }
        }
    }
}
