//! candle's CPU threads, set for a machine with few cores.
//!
//! candle runs matrix products on rayon's pool and element-wise work (the
//! engine's own kernels too) on its own barrier pool, and two of its
//! defaults cost an engine dearly on a small machine (measured on the 2-core
//! VM of docs/BENCHMARKS.md, Gemma 3 270M with f32 weights):
//!
//! - Each matrix product asks for the thread count, which without
//!   `RAYON_NUM_THREADS` re-reads `/proc/cpuinfo`: 29 us a product, about
//!   5 ms of a 30 ms decode step.
//! - After each piece of work the barrier pool's workers spin 25,000 times
//!   before they park, on the cores the next matrix product runs on: a
//!   193-token prefill over 1,400 cached tokens took 426-500 ms, 365-390 ms
//!   with the limit at 2,000 (a 1,094-token prefill from scratch the same
//!   ~2.1 s either way).
//!
//! [`tune_cpu_threads`] sets both, unless the environment already does.

/// The spin limit [`tune_cpu_threads`] gives candle's barrier pool.
pub const BARRIER_SPIN_LIMIT: u32 = 2_000;

const THREADS_ENV: &str = "RAYON_NUM_THREADS";
const SPIN_ENV: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";

/// What candle's CPU threads run with after [`tune_cpu_threads`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuThreads {
    /// Threads per matrix product (`RAYON_NUM_THREADS`).
    pub threads: usize,
    /// Spins before an idle barrier-pool worker parks
    /// (`CANDLE_BARRIER_POOL_SPIN_LIMIT`), when set.
    pub spin_limit: Option<u32>,
}

/// Fixes candle's thread count in `RAYON_NUM_THREADS` (the count candle
/// would find itself, read once) and lowers its barrier pool's spin limit to
/// [`BARRIER_SPIN_LIMIT`], leaving either alone when the environment sets it.
/// The spin limit takes effect only if candle has not started its barrier
/// pool yet. Returns what applies.
///
/// # Safety
///
/// This sets environment variables: call it at the start of `main`, before
/// any other thread runs (another thread reading the environment meanwhile
/// is a data race on most platforms).
pub unsafe fn tune_cpu_threads() -> CpuThreads {
    let threads = match std::env::var(THREADS_ENV).ok().and_then(|v| v.parse().ok()) {
        Some(n) if n > 0 => n,
        _ => {
            let n = candle_core::utils::get_num_threads();
            std::env::set_var(THREADS_ENV, n.to_string());
            n
        }
    };
    let spin_limit = match std::env::var(SPIN_ENV) {
        Ok(v) => v.parse().ok(),
        Err(_) => {
            std::env::set_var(SPIN_ENV, BARRIER_SPIN_LIMIT.to_string());
            Some(BARRIER_SPIN_LIMIT)
        }
    };
    CpuThreads { threads, spin_limit }
}
