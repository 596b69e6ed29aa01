//! Several threads hammering one prefix trie through `kvcache_api::Shared`: each
//! runs whole requests (begin, prefill, generate, close) under the lock on
//! conversations that share a system prompt, so every turn switches the trie's
//! active path. After every request the caches hold exactly the conversation and
//! the checker passes; at the end every conversation is in the trie, the counters
//! add up and no snapshot leaks.

mod trie_support;

use std::sync::{Arc, Barrier};
use std::thread;

use kvcache_api::Shared;
use trie_support::{cache, request};

const THREADS: usize = 4;
const TURNS: usize = 60;

#[test]
fn threads_take_whole_requests_in_turn() {
    let (trie, counters) = cache("kkr", usize::MAX);
    let trie = Shared::new(trie);
    let start = Arc::new(Barrier::new(THREADS));
    let workers: Vec<_> = (0..THREADS as u32)
        .map(|t| {
            let (trie, counters, start) = (trie.clone(), counters.clone(), start.clone());
            thread::spawn(move || -> (Vec<u32>, usize) {
                start.wait();
                let mut transcript = vec![1, 2, 3, 4];
                let mut reused = 0;
                for turn in 0..TURNS as u32 {
                    transcript.extend([100 + t, turn]);
                    let generated = [200 + t, 300 + turn];
                    let mut guard = trie.lock().unwrap();
                    // `request` checks the caches and the trie after every step.
                    let out = request(&mut guard, &counters, &transcript, &generated);
                    if turn > 0 {
                        // The thread's previous turn is a prefix of this one.
                        assert!(
                            out.cached >= transcript.len() - 3,
                            "thread {t} turn {turn}: {out:?}"
                        );
                    }
                    reused += out.cached;
                    drop(guard);
                    transcript.push(generated[0]);
                }
                (transcript, reused)
            })
        })
        .collect();
    let results: Vec<(Vec<u32>, usize)> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    let trie = trie.into_inner().expect("the workers dropped their handles");
    trie.check();
    for (t, (transcript, reused)) in results.iter().enumerate() {
        assert_eq!(
            trie.lookup(transcript),
            transcript.len(),
            "thread {t}'s conversation"
        );
        assert!(*reused > 0);
    }
    let s = trie.stats();
    assert_eq!(s.hits + s.misses, (THREADS * TURNS) as u64);
    assert_eq!(counters.alive(), s.snapshots);
    drop(trie);
    assert_eq!(counters.alive(), 0, "snapshots leaked");
}
