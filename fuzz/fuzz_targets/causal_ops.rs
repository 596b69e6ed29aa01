//! cargo-fuzz target `causal_ops`: see `fuzz/drivers/causal.rs` for what it checks.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvcache_fuzz::causal::fuzz(data);
});
