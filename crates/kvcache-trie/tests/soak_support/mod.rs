//! The soak's workload and figures, shared by the soak over fake layer caches
//! (`soak.rs`) and the one over mlx-rs caches (`kvcache-mlx/tests/soak.rs`,
//! which includes this file and `trie_support` by path).
#![allow(dead_code)]

use super::trie_support::Options;

/// A field of `/proc/self/status` in KiB (`VmRSS`, `VmHWM`); `None` off Linux.
pub fn status_kib(field: &str) -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

pub fn requests() -> usize {
    std::env::var("KVCACHE_SOAK_REQUESTS")
        .map(|v| v.parse().expect("KVCACHE_SOAK_REQUESTS must be a number"))
        .unwrap_or(10_000)
}

/// A deterministic xorshift generator.
pub struct Rng(u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// `lo..=hi` random tokens.
    pub fn tokens(&mut self, lo: usize, hi: usize) -> Vec<u32> {
        let n = lo + self.below(hi - lo + 1);
        (0..n).map(|_| self.below(40) as u32).collect()
    }
}

/// What the next request looks like.
pub struct Request {
    pub prompt: Vec<u32>,
    pub generated: Vec<u32>,
    pub options: Options,
}

/// A workload of chat conversations: a pool of 48 transcripts that grow turn by
/// turn, get edited, repeated and replaced; a transcript longer than 160 tokens
/// starts over, so shapes stay small.
pub struct Workload {
    rng: Rng,
    conversations: Vec<Vec<u32>>,
}

impl Workload {
    pub fn new(seed: u64) -> Self {
        Workload {
            rng: Rng(seed),
            conversations: Vec::new(),
        }
    }

    pub fn next(&mut self) -> Request {
        let rng = &mut self.rng;
        let n = self.conversations.len();
        let pick = rng.below(n.max(1));
        let mut options = Options::default();
        let prompt = match rng.below(20) {
            _ if n == 0 => rng.tokens(1, 12),
            0..=2 => rng.tokens(1, 12),
            3..=11 => {
                let extra = rng.tokens(1, 8);
                [&self.conversations[pick][..], &extra].concat()
            }
            12..=14 => {
                let base = &self.conversations[pick];
                let cut = rng.below(base.len() + 1);
                let extra = rng.tokens(1, 6);
                [&base[..cut], &extra].concat()
            }
            15..=16 => self.conversations[pick].clone(),
            17 => {
                options.user_snapshot = true;
                let extra = rng.tokens(1, 4);
                [&self.conversations[pick][..], &extra].concat()
            }
            _ => {
                options.abandon_after = Some(rng.below(6));
                let extra = rng.tokens(1, 6);
                [&self.conversations[pick][..], &extra].concat()
            }
        };
        let prompt = if prompt.is_empty() { vec![0] } else { prompt };
        let generated = if options.abandon_after.is_some() {
            vec![]
        } else {
            rng.tokens(0, 4)
        };
        if options.abandon_after.is_none() {
            let mut transcript = [&prompt[..], &generated[..]].concat();
            if transcript.len() > 160 {
                transcript = rng.tokens(4, 4);
            }
            if n < 48 {
                self.conversations.push(transcript);
            } else {
                self.conversations[pick] = transcript;
            }
        }
        Request {
            prompt,
            generated,
            options,
        }
    }
}

/// Peak figures of a soak.
#[derive(Debug, Default)]
pub struct Peaks {
    pub paged_out: usize,
    pub nodes: usize,
    pub snapshots: usize,
    pub rss_kib_after_warmup: usize,
    pub rss_kib_peak: usize,
}
