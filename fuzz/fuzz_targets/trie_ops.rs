//! cargo-fuzz target `trie_ops`: see `fuzz/drivers/trie.rs` for what it checks.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvcache_fuzz::trie::fuzz(data);
});
