//! `tune_cpu_threads` in a process of its own (it sets the environment, so
//! this file holds one test).

use kvcache_models::threads::{tune_cpu_threads, CpuThreads, BARRIER_SPIN_LIMIT};

#[test]
fn sets_what_is_unset_and_keeps_what_the_user_set() {
    std::env::remove_var("RAYON_NUM_THREADS");
    std::env::remove_var("CANDLE_BARRIER_POOL_SPIN_LIMIT");
    let found = candle_core::utils::get_num_threads();
    // SAFETY: the only test of this binary; nothing else reads the environment.
    let tuned = unsafe { tune_cpu_threads() };
    assert_eq!(
        tuned,
        CpuThreads {
            threads: found,
            spin_limit: Some(BARRIER_SPIN_LIMIT)
        }
    );
    assert_eq!(std::env::var("RAYON_NUM_THREADS").unwrap(), found.to_string());
    assert_eq!(
        std::env::var("CANDLE_BARRIER_POOL_SPIN_LIMIT").unwrap(),
        BARRIER_SPIN_LIMIT.to_string()
    );
    // candle now takes the count from the environment.
    assert_eq!(candle_core::utils::get_num_threads(), found);

    std::env::set_var("RAYON_NUM_THREADS", "3");
    std::env::set_var("CANDLE_BARRIER_POOL_SPIN_LIMIT", "50");
    let kept = unsafe { tune_cpu_threads() };
    assert_eq!(
        kept,
        CpuThreads {
            threads: 3,
            spin_limit: Some(50)
        }
    );
    assert_eq!(std::env::var("RAYON_NUM_THREADS").unwrap(), "3");
    assert_eq!(candle_core::utils::get_num_threads(), 3);
}
