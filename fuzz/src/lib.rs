//! The drivers behind the cargo-fuzz targets. The same files are compiled into
//! the bounded replays of `cargo xtask test` (`crates/*/tests/fuzz_*.rs`).

#[path = "../drivers/batch.rs"]
pub mod batch;
#[path = "../drivers/causal.rs"]
pub mod causal;
#[path = "../drivers/input.rs"]
pub mod input;
#[path = "../drivers/trie.rs"]
pub mod trie;
