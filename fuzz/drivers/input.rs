//! Reading fuzz input, and running it as a bounded test.
//!
//! Shared by the cargo-fuzz targets (`fuzz/fuzz_targets/*`) and the replays inside
//! `cargo xtask test` (`crates/*/tests/fuzz_*.rs`), which include this file by path.
#![allow(dead_code)]

use std::fmt::Debug;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// A cursor over fuzz bytes. Past the end every read returns zero, so every byte
/// string decodes to some operation list and short inputs mean short runs.
pub struct Input<'a> {
    bytes: &'a [u8],
}

impl<'a> Input<'a> {
    /// A cursor at the start of `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        Input { bytes }
    }

    /// Whether every byte has been read.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The next byte (0 past the end).
    pub fn u8(&mut self) -> u8 {
        match self.bytes.split_first() {
            Some((&b, rest)) => {
                self.bytes = rest;
                b
            }
            None => 0,
        }
    }

    /// The next two bytes, little-endian.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    /// The next four bytes, little-endian.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    /// A number in `0..n` (`n > 0`) from one byte.
    pub fn below(&mut self, n: usize) -> usize {
        usize::from(self.u8()) % n
    }

    /// A number in `lo..=hi` from one byte.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    /// True with probability about `percent`%.
    pub fn chance(&mut self, percent: u8) -> bool {
        self.u8() % 100 < percent
    }

    /// One of `items`.
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }
}

/// A deterministic generator of test inputs (xorshift64*), so that every bounded
/// run tries the same inputs and a failure names the case that reproduces it.
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// `len` random bytes, `len` itself random in `0..max_len`.
    pub fn bytes(&mut self, max_len: usize) -> Vec<u8> {
        let len = (self.next() % max_len as u64) as usize;
        (0..len).map(|_| self.next() as u8).collect()
    }
}

/// Number of generated cases a bounded run tries: `KVCACHE_FUZZ_CASES`, else
/// `default`.
pub fn cases(default: usize) -> usize {
    match std::env::var("KVCACHE_FUZZ_CASES") {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("KVCACHE_FUZZ_CASES must be a number, not {v:?}")),
        Err(_) => default,
    }
}

/// Runs `run` on `setup` and `ops` and returns its result; on a panic, shrinks
/// `ops` (dropping operations while the failure stays) and panics with the
/// smallest failing operation list.
pub fn run_shrinking<S: Debug, O: Clone + Debug, R>(
    name: &str,
    setup: &S,
    ops: &[O],
    run: impl Fn(&S, &[O]) -> R,
) -> R {
    if let Ok(result) = catch_unwind(AssertUnwindSafe(|| run(setup, ops))) {
        return result;
    }
    let fails = |ops: &[O]| catch_unwind(AssertUnwindSafe(|| run(setup, ops))).is_err();
    // Quiet while shrinking: every attempt that still fails would print its panic.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let mut ops = ops.to_vec();
    let mut chunk = (ops.len() / 2).max(1);
    loop {
        let mut removed = false;
        let mut i = 0;
        while i < ops.len() {
            let mut shorter = ops.clone();
            shorter.drain(i..(i + chunk).min(ops.len()));
            if fails(&shorter) {
                ops = shorter;
                removed = true;
            } else {
                i += chunk;
            }
        }
        if chunk == 1 {
            if !removed {
                break;
            }
        } else {
            chunk /= 2;
        }
    }
    std::panic::set_hook(hook);
    // Run once more, loudly, for the panic message.
    let message = catch_unwind(AssertUnwindSafe(|| run(setup, &ops)))
        .err()
        .map(|p| {
            p.downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default()
        })
        .unwrap_or_default();
    panic!("{name}: {message}\nminimal reproducer:\nsetup: {setup:#?}\nops: {ops:#?}");
}

/// The files of `fuzz/corpus/<target>` (the committed, minimised cargo-fuzz
/// corpus), if any, in name order.
pub fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut files: Vec<(String, Vec<u8>)> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_file())
        .map(|e| {
            let bytes = std::fs::read(e.path()).expect("readable corpus file");
            (e.file_name().to_string_lossy().into_owned(), bytes)
        })
        .collect();
    files.sort();
    files
}
