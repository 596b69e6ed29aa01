//! cargo-fuzz target `batch`: see `fuzz/drivers/batch.rs` for what it checks.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvcache_fuzz::batch::fuzz(data);
});
