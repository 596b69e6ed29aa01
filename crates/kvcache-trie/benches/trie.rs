//! P1 (match) and P2 (evict) of docs/BENCHMARKS.md, on fake caches.
//!
//! `cargo bench -p kvcache-trie --bench trie` (add `-- --quick`, or set
//! `TRIE_BENCH_QUICK=1`, for a smaller run). Plain `std` timing; every figure
//! is the median of several runs.

use std::hint::black_box;
use std::time::Instant;

use kvcache_api::CacheError;
use kvcache_trie::fake::{feed_all, Counters, FakeKv};
use kvcache_trie::PrefixCache;

/// xorshift64*: deterministic and dependency-free.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn token(&mut self) -> u32 {
        (self.next() % 50_000) as u32
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// A conversation tree: conversation `i` continues `parent[i]`'s tokens up to
/// `branch[i]` and then adds `own` tokens of its own (seeded by `i`).
struct Conversations {
    system: Vec<u32>,
    parent: Vec<usize>,
    branch: Vec<usize>,
    own: usize,
}

impl Conversations {
    /// `n` conversations, each adding `own` tokens in turns of `every` tokens
    /// (+-10%) after a shared `system`-token prompt. A quarter continue an
    /// earlier conversation at its end (the next message of a chat); the others
    /// branch off one at one of its turn boundaries (an edited or regenerated turn).
    fn new(n: usize, system: usize, own: usize, every: usize, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let system = (0..system).map(|_| rng.token()).collect();
        let (mut parent, mut branch, mut len) = (vec![usize::MAX], vec![0], vec![own]);
        for i in 1..n {
            let p = rng.below(i);
            let b = if rng.below(4) == 0 {
                len[p]
            } else {
                // Turn boundaries of p's own tokens.
                let start = len[p] - own;
                let mut turns = Rng::new(0x7u64 << 32 | p as u64);
                let mut bounds = vec![start];
                let mut at = 0;
                loop {
                    at += every - every / 10 + turns.below(every / 5 + 1);
                    if at >= own {
                        break;
                    }
                    bounds.push(start + at);
                }
                bounds[rng.below(bounds.len())]
            };
            parent.push(p);
            branch.push(b);
            len.push(b + own);
        }
        Conversations {
            system,
            parent,
            branch,
            own,
        }
    }

    fn len(&self) -> usize {
        self.parent.len()
    }

    /// Conversation `i`'s tokens (system prompt included), truncated to `max`.
    fn tokens(&self, i: usize, max: usize) -> Vec<u32> {
        // The chain of ancestors, each with how many tokens after the system
        // prompt its descendants keep of it.
        let mut chain = vec![];
        let (mut c, mut limit) = (i, max.saturating_sub(self.system.len()));
        loop {
            chain.push((c, limit));
            if self.parent[c] == usize::MAX {
                break;
            }
            limit = limit.min(self.branch[c]);
            c = self.parent[c];
        }
        let mut seq = vec![];
        for &(c, limit) in chain.iter().rev() {
            let start = if self.parent[c] == usize::MAX {
                0
            } else {
                self.branch[c]
            };
            if seq.len() < start {
                continue; // a descendant branches off before this one's tokens
            }
            seq.truncate(start);
            let mut rng = Rng::new(0x5eed ^ c as u64);
            seq.extend((0..self.own.min(limit.saturating_sub(start))).map(|_| rng.token()));
        }
        let mut out = self.system.clone();
        out.extend_from_slice(&seq);
        out.truncate(max);
        out
    }

    fn full_len(&self, i: usize) -> usize {
        self.system.len()
            + if self.parent[i] == usize::MAX {
                self.own
            } else {
                self.branch[i] + self.own
            }
    }
}

fn eval(tokens: &[u32], caches: &mut [FakeKv]) -> Result<(), CacheError> {
    feed_all(caches, tokens);
    Ok(())
}

/// Runs one request that evaluates `prompt` and closes.
fn serve(cache: &mut PrefixCache<FakeKv>, prompt: &[u32]) {
    let mut s = cache.begin(prompt).unwrap();
    s.prefill(eval).unwrap();
    s.close().unwrap();
}

struct Sizes {
    p1_conversations: usize,
    p1_prompts: Vec<usize>,
    p1_runs: usize,
    p2_nodes: Vec<usize>,
    p2_runs: usize,
}

fn p1(sizes: &Sizes) {
    let (system, own, every, layers) = (500, 1_500, 200, 2);
    let convs = Conversations::new(sizes.p1_conversations, system, own, every, 1);
    let counters = Counters::new();
    let caches = (0..layers).map(|_| FakeKv::new(&counters)).collect();
    let mut cache = PrefixCache::new(caches, usize::MAX).unwrap();
    let t = Instant::now();
    let mut total = 0usize;
    for i in 0..convs.len() {
        let tokens = convs.tokens(i, usize::MAX);
        total += tokens.len();
        serve(&mut cache, &tokens);
    }
    let build = t.elapsed();
    let stats = cache.stats();

    // The deepest conversation serves the prompts; another one is the path
    // the "switch" rows page out of.
    let deepest = (0..convs.len()).max_by_key(|&i| convs.full_len(i)).unwrap();
    let longest = convs.full_len(deepest);
    let max_prompt = *sizes.p1_prompts.iter().max().unwrap();
    assert!(
        longest > max_prompt,
        "no conversation reaches {max_prompt} tokens (longest {longest})"
    );
    let path = convs.tokens(deepest, max_prompt);
    let other = convs.tokens((deepest + 1) % convs.len(), 1_000);

    println!("P1 match: begin() on a trie of conversations, fake KV caches");
    println!(
        "  trie: {} conversations, each adding {own} tokens in turns of ~{every} to the shared {system}-token \
         system prompt (the first: {} tokens) or to an earlier conversation, branching off it at one of its \
         turn boundaries (3/4) or continuing it at its end (1/4); {layers} FakeKv layers",
        convs.len(),
        system + own
    );
    println!(
        "  built in {:.2} s: {} nodes, {} snapshots, {:.1} MB paged out, {} prompt tokens served, \
         deepest conversation {} tokens",
        build.as_secs_f64(),
        stats.nodes,
        stats.snapshots,
        stats.paged_out_bytes as f64 / 1e6,
        total,
        longest
    );
    println!(
        "  prompt = the deepest conversation's first N tokens + 1 new token; median of {} runs",
        sizes.p1_runs
    );
    println!("  hot: the path is already live (match only); switch: paged in from snapshots after another conversation");
    println!(
        "  {:>6} {:>8} {:>10} {:>14} {:>12} {:>16}",
        "N", "matched", "hot us", "hot ns/token", "switch us", "switch ns/token"
    );
    for &n in &sizes.p1_prompts {
        let mut prompt = path[..n].to_vec();
        prompt.push(u32::MAX);
        // Warm up: the first begin splits the edge at N; later ones reuse it.
        drop(cache.begin(&prompt).unwrap());
        let (mut hot, mut switch) = (vec![], vec![]);
        let mut matched = 0;
        for _ in 0..sizes.p1_runs {
            drop(cache.begin(&other).unwrap());
            let t = Instant::now();
            let s = cache.begin(black_box(&prompt)).unwrap();
            switch.push(t.elapsed().as_nanos() as f64);
            matched = s.cached();
            drop(s);
            let t = Instant::now();
            let s = cache.begin(black_box(&prompt)).unwrap();
            hot.push(t.elapsed().as_nanos() as f64);
            assert_eq!(s.cached(), matched);
            drop(s);
        }
        assert_eq!(matched, n, "the prompt's first {n} tokens are cached");
        let (hot, switch) = (median(hot), median(switch));
        println!(
            "  {:>6} {:>8} {:>10.2} {:>14.2} {:>12.2} {:>16.2}",
            n,
            matched,
            hot / 1e3,
            hot / matched as f64,
            switch / 1e3,
            switch / matched as f64
        );
    }
    cache.check();
}

/// Builds a trie of at least `nodes` nodes, nearly all holding snapshots:
/// short conversations (16 tokens of their own) branching off random earlier
/// ones at random points. One FakeKv layer, no budget.
fn p2_trie(nodes: usize, seed: u64) -> (PrefixCache<FakeKv>, Counters) {
    let counters = Counters::new();
    let mut cache = PrefixCache::new(vec![FakeKv::new(&counters)], usize::MAX).unwrap();
    let mut rng = Rng::new(seed);
    let mut convs: Vec<Vec<u32>> = vec![];
    while cache.stats().nodes < nodes {
        let mut tokens = if convs.is_empty() {
            vec![]
        } else {
            let p = &convs[rng.below(convs.len())];
            p[..rng.below(p.len() + 1)].to_vec()
        };
        tokens.extend((0..16).map(|_| rng.token()));
        serve(&mut cache, &tokens);
        convs.push(tokens);
    }
    // Page the last conversation out too.
    serve(&mut cache, &[u32::MAX]);
    (cache, counters)
}

fn p2(sizes: &Sizes) {
    println!();
    println!("P2 evict: one eviction pass down to half the paged-out bytes");
    println!(
        "  trie: conversations of 16 own tokens branching off random earlier ones at random points, \
         1 FakeKv layer; median of {} builds",
        sizes.p2_runs
    );
    println!(
        "  {:>8} {:>10} {:>12} {:>10} {:>10} {:>14}",
        "nodes", "snapshots", "paged-out KB", "evicted", "pass ms", "ns/eviction"
    );
    // Sizes alternate within each run, so that drift on a shared machine hits both.
    let mut times = vec![vec![]; sizes.p2_nodes.len()];
    let mut rows = vec![(0, 0, 0, 0); sizes.p2_nodes.len()];
    for run in 0..sizes.p2_runs {
        for (k, &n) in sizes.p2_nodes.iter().enumerate() {
            let (mut cache, counters) = p2_trie(n, 7 + run as u64);
            let before = cache.stats();
            let t = Instant::now();
            cache.set_budget(before.paged_out_bytes / 2);
            let elapsed = t.elapsed().as_nanos() as f64;
            let after = cache.stats();
            let evicted = after.evictions - before.evictions;
            assert!(after.paged_out_bytes <= after.budget);
            times[k].push(elapsed / evicted as f64);
            rows[k] = (
                before.nodes,
                before.snapshots,
                before.paged_out_bytes,
                evicted as usize,
            );
            if run == 0 {
                cache.check();
            }
            drop(cache);
            assert_eq!(counters.created(), counters.dropped());
        }
    }
    let ratios: Vec<f64> = (0..sizes.p2_runs)
        .map(|r| times[times.len() - 1][r] / times[0][r])
        .collect();
    for (k, t) in times.into_iter().enumerate() {
        let ns = median(t);
        let (nodes, snapshots, bytes, evicted) = rows[k];
        println!(
            "  {:>8} {:>10} {:>12.1} {:>10} {:>10.2} {:>14.1}",
            nodes,
            snapshots,
            bytes as f64 / 1e3,
            evicted,
            ns * evicted as f64 / 1e6,
            ns
        );
    }
    println!(
        "  growth per evicted node, {} -> {} nodes: {:.2}x (median of the per-run ratios)",
        sizes.p2_nodes[0],
        sizes.p2_nodes[sizes.p2_nodes.len() - 1],
        median(ratios)
    );
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick") || std::env::var_os("TRIE_BENCH_QUICK").is_some();
    let sizes = if quick {
        Sizes {
            p1_conversations: 1_000,
            p1_prompts: vec![1_000, 2_000, 4_000, 8_000],
            p1_runs: 5,
            // The target compares 10k with 100k nodes; smaller tries fit in
            // the CPU caches and would not compare like with like.
            p2_nodes: vec![10_000, 100_000],
            p2_runs: 2,
        }
    } else {
        Sizes {
            p1_conversations: 10_000,
            p1_prompts: vec![1_000, 2_000, 4_000, 8_000],
            p1_runs: 15,
            p2_nodes: vec![10_000, 100_000],
            p2_runs: 5,
        }
    };
    // `p1` or `p2` as an argument runs that one only.
    let only: Vec<String> = std::env::args().filter(|a| a == "p1" || a == "p2").collect();
    let t = Instant::now();
    if only.is_empty() || only.iter().any(|a| a == "p1") {
        p1(&sizes);
    }
    if only.is_empty() || only.iter().any(|a| a == "p2") {
        p2(&sizes);
    }
    println!();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load = load.split_whitespace().next().unwrap_or("?");
    println!(
        "total {:.1} s{}; load average {load}",
        t.elapsed().as_secs_f64(),
        if quick { " (quick)" } else { "" }
    );
}
