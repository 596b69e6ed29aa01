//! P3 (spec BENCHMARKS.md): paging a SmolLM2-shaped model's KV caches out to
//! snapshots and back in, on mlx-rs CPU arrays, as a fraction of the memcpy
//! bandwidth measured in the same run.
//!
//! `cargo xtask bench -p kvcache-mlx --bench page` (on Linux the xtask turns mlx-rs on).
//! Optional arguments after `--`: `--runs N` (default 9), `--tokens N` (default 8192).
//!
//! The machines are shared and noisy: every run times the memcpy baseline next
//! to the operations, and the table reports medians. The last column counts the
//! minor page faults an operation took (Linux): 0 means its new buffers came from
//! memory the allocator had recycled, not fresh pages from the kernel.

#[cfg(not(any(target_os = "macos", kvcache_mlx)))]
fn main() {
    println!("page: skipped, mlx-rs is not enabled here (run it through `cargo xtask bench`)");
}

#[cfg(any(target_os = "macos", kvcache_mlx))]
fn main() {
    p3::run();
}

#[cfg(any(target_os = "macos", kvcache_mlx))]
mod p3 {
    use std::hint::black_box;
    use std::time::{Duration, Instant};

    use half::f16;
    use kvcache_api::{BoxedSnapshot, LayerCache, SnapshotCache};
    use kvcache_mlx::layers::KvCache;
    use mlx_rs::Array;

    const LAYERS: usize = 30;
    const KV_HEADS: usize = 3;
    const HEAD_DIM: usize = 64;
    const ELEM: usize = 2; // f16
    /// Positions before the paged range: the snapshot is a strided slice of a
    /// larger live buffer, as when a conversation branches after a shared prefix.
    const PREFIX: usize = 256;

    struct Args {
        runs: usize,
        tokens: usize,
    }

    fn args() -> Args {
        let mut out = Args {
            runs: 9,
            tokens: 8192,
        };
        let mut it = std::env::args().skip(1);
        while let Some(arg) = it.next() {
            let mut value = |name: &str| -> usize {
                it.next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("{name} takes a positive number"))
            };
            match arg.as_str() {
                "--runs" => out.runs = value("--runs").max(1),
                "--tokens" => out.tokens = value("--tokens").max(1),
                _ => {} // `--bench` and filters from cargo
            }
        }
        out
    }

    /// `[1, KV_HEADS, tokens, HEAD_DIM]` f16 with varied contents.
    fn array(tokens: usize, seed: usize) -> Array {
        let n = KV_HEADS * tokens * HEAD_DIM;
        let data: Vec<f16> = (0..n)
            .map(|i| f16::from_f32(((i * 7 + seed * 13) % 2011) as f32 / 64.0))
            .collect();
        Array::from_slice(&data, &[1, KV_HEADS as i32, tokens as i32, HEAD_DIM as i32])
    }

    fn eval_all(caches: &[KvCache]) {
        let state: Vec<Array> = caches.iter().flat_map(|c| c.state()).collect();
        mlx_rs::transforms::eval(&state).expect("eval");
    }

    /// Caches holding `len` positions each.
    fn filled(len: usize) -> Vec<KvCache> {
        let (k, v) = (array(len, 1), array(len, 2));
        let mut caches: Vec<KvCache> = (0..LAYERS).map(|_| KvCache::new()).collect();
        for c in &mut caches {
            c.update(&k, &v).expect("update");
        }
        eval_all(&caches);
        caches
    }

    /// The restored cache holds exactly what was written.
    fn check(cache: &KvCache, keys: &Array, values: &Array) {
        let (k, v) = cache.live().unwrap().unwrap();
        assert!(
            k.eq_values(keys).unwrap() && v.eq_values(values).unwrap(),
            "restored data differs"
        );
    }

    /// One operation's times and the memcpy times measured just before each.
    struct Row {
        name: &'static str,
        times: Vec<Duration>,
        bases: Vec<Duration>,
        faults: Vec<u64>,
    }

    impl Row {
        fn new(name: &'static str) -> Self {
            Row {
                name,
                times: Vec::new(),
                bases: Vec::new(),
                faults: Vec::new(),
            }
        }

        fn push(&mut self, base: Duration, time: Duration, faults: u64) {
            self.faults.push(faults);
            self.bases.push(base);
            self.times.push(time);
        }

        /// Median over runs of memcpy time / operation time.
        fn median_ratio(&self) -> f64 {
            let mut ratios: Vec<f64> = self
                .bases
                .iter()
                .zip(&self.times)
                .map(|(b, t)| b.as_secs_f64() / t.as_secs_f64())
                .collect();
            ratios.sort_by(f64::total_cmp);
            ratios[ratios.len() / 2]
        }
    }

    /// Minor page faults of this process so far (Linux; 0 elsewhere).
    fn minor_faults() -> u64 {
        std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|s| {
                // Fields after the command name, which ends with the last ')'.
                let rest = &s[s.rfind(')')? + 2..];
                rest.split(' ').nth(7)?.parse().ok()
            })
            .unwrap_or(0)
    }

    fn median(mut xs: Vec<Duration>) -> Duration {
        xs.sort();
        xs[xs.len() / 2]
    }

    pub fn run() {
        let Args { runs, tokens } = args();
        let bytes = LAYERS * 2 * KV_HEADS * tokens * HEAD_DIM * ELEM;
        let end = PREFIX + tokens;

        let mut live = filled(end);
        // Snapshots of [0, tokens) for restoring into empty caches.
        let from_zero: Vec<BoxedSnapshot> = {
            let mut c = filled(tokens);
            c.iter_mut().map(|c| c.snapshot(0).unwrap().unwrap()).collect()
        };
        let src: Vec<u8> = (0..bytes).map(|i| (i * 31 % 251) as u8).collect();
        let mut dst = vec![0u8; bytes];
        let mut memcpy = || {
            let t = Instant::now();
            dst.copy_from_slice(black_box(&src));
            black_box(&mut dst);
            t.elapsed()
        };

        // Each operation is timed right after a memcpy of the same bytes, and
        // compared with it as a ratio, run by run: the load on these shared
        // machines changes from second to second.
        let mut rows: [Row; 4] = [
            Row::new("memcpy into 60 new Vec<u8> (new allocations, for reference)"),
            Row::new("snapshot [256, 256+N) of every layer (compact copies)"),
            Row::new("restore over a cache rewound to 256 (buffer reused in place)"),
            Row::new("restore [0, N) into empty caches (new buffers)"),
        ];
        for run in 0..runs {
            // What paging out pays on top of copying: fresh memory, one buffer
            // per layer and K/V.
            let base = memcpy();
            let f = minor_faults();
            let t = Instant::now();
            let copies: Vec<Vec<u8>> = src.chunks(bytes / (2 * LAYERS)).map(<[u8]>::to_vec).collect();
            black_box(&copies);
            let time = t.elapsed();
            rows[0].push(base, time, minor_faults() - f);
            drop(copies);

            // Page out [PREFIX, end) of every layer.
            let base = memcpy();
            let f = minor_faults();
            let t = Instant::now();
            let snaps: Vec<BoxedSnapshot> = live
                .iter_mut()
                .map(|c| c.snapshot(PREFIX).unwrap().unwrap())
                .collect();
            let time = t.elapsed();
            rows[1].push(base, time, minor_faults() - f);
            assert_eq!(snaps.iter().map(|s| s.size_bytes()).sum::<usize>(), bytes);

            // Page back in over a cache rewound to the prefix.
            for c in &mut live {
                assert!(c.restore(None, PREFIX).unwrap());
            }
            let base = memcpy();
            let f = minor_faults();
            let t = Instant::now();
            for (c, s) in live.iter_mut().zip(&snaps) {
                assert!(c.restore(Some(&**s), end).unwrap());
            }
            eval_all(&live);
            let time = t.elapsed();
            rows[2].push(base, time, minor_faults() - f);
            drop(snaps);

            // Page in to empty caches (a new buffer per layer).
            let mut empty: Vec<KvCache> = (0..LAYERS).map(|_| KvCache::new()).collect();
            let base = memcpy();
            let f = minor_faults();
            let t = Instant::now();
            for (c, s) in empty.iter_mut().zip(&from_zero) {
                assert!(c.restore(Some(&**s), tokens).unwrap());
            }
            eval_all(&empty);
            let time = t.elapsed();
            rows[3].push(base, time, minor_faults() - f);
            if run == 0 {
                check(&empty[0], &array(tokens, 1), &array(tokens, 2));
            }
        }
        check(&live[LAYERS - 1], &array(end, 1), &array(end, 2));

        let gbs = |d: Duration| bytes as f64 / d.as_secs_f64() / 1e9;
        let all_bases: Vec<Duration> = rows.iter().flat_map(|r| r.bases.iter().copied()).collect();
        let base = median(all_bases);
        println!(
            "P3 page out/in: {LAYERS} layers x {KV_HEADS} KV heads x head dim {HEAD_DIM}, f16, batch 1, \
             {tokens}-token range ({:.1} MB of K+V), mlx-rs CPU arrays, {runs} runs",
            bytes as f64 / 1e6
        );
        println!(
            "memcpy baseline (Rust copy_from_slice of the same bytes, timed before every operation): \
             median {:.2} ms, {:.2} GB/s",
            base.as_secs_f64() * 1e3,
            gbs(base)
        );
        println!(
            "| operation | median ms | GB/s | vs adjacent memcpy (median of per-run ratios) | page faults (median) |"
        );
        println!("|---|---|---|---|---|");
        for row in rows {
            let m = median(row.times.clone());
            let mut faults = row.faults.clone();
            faults.sort_unstable();
            println!(
                "| {} | {:.2} | {:.2} | {:.0}% | {} |",
                row.name,
                m.as_secs_f64() * 1e3,
                gbs(m),
                100.0 * row.median_ratio(),
                faults[faults.len() / 2]
            );
        }
    }
}
