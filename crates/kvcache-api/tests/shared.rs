//! `Shared`: several threads hammering one cache, poisoning and recovery, and the
//! non-blocking and ownership paths.

use std::sync::Barrier;
use std::thread;

use kvcache_api::{CacheError, Shared, SharedGuard};

/// A stand-in cache: a log of `(thread, pass, step)` entries written in passes of
/// several steps, which must never interleave.
#[derive(Debug, Default)]
struct Log(Vec<(usize, usize, usize)>);

const THREADS: usize = 8;
const PASSES: usize = 500;
const STEPS: usize = 4;

#[test]
fn threads_take_whole_passes_in_turn() {
    let cache = Shared::new(Log::default());
    let start = std::sync::Arc::new(Barrier::new(THREADS));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (cache, start) = (cache.clone(), start.clone());
            thread::spawn(move || {
                start.wait();
                for pass in 0..PASSES {
                    if pass % 2 == 0 {
                        let mut guard = cache.lock().unwrap();
                        for step in 0..STEPS {
                            guard.0.push((t, pass, step));
                        }
                    } else {
                        cache
                            .with(|log| (0..STEPS).for_each(|step| log.0.push((t, pass, step))))
                            .unwrap();
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    assert_eq!(cache.handles(), 1);
    let log = cache.into_inner().unwrap().0;
    assert_eq!(log.len(), THREADS * PASSES * STEPS);
    // Passes never interleave, and each thread's passes arrive in order.
    let mut next = [0usize; THREADS];
    for chunk in log.chunks(STEPS) {
        let (t, pass, _) = chunk[0];
        let want: Vec<_> = (0..STEPS).map(|s| (t, pass, s)).collect();
        assert_eq!(chunk, &want[..], "interleaved pass");
        assert_eq!(pass, next[t], "thread {t} out of order");
        next[t] += 1;
    }
    assert_eq!(next, [PASSES; THREADS]);
}

#[test]
fn a_panic_poisons_until_recovered() {
    let cache = Shared::new(vec![1, 2, 3]);
    let worker = cache.clone();
    let joined = thread::spawn(move || {
        let mut guard = worker.lock().unwrap();
        guard.push(99);
        panic!("model failure while holding the cache");
    })
    .join();
    assert!(joined.is_err());
    assert!(cache.is_poisoned());
    assert!(matches!(cache.lock(), Err(CacheError::InvalidState(m)) if m.contains("poisoned")));
    assert!(matches!(cache.try_lock(), Err(CacheError::InvalidState(_))));
    assert!(matches!(
        cache.with(|c| c.len()),
        Err(CacheError::InvalidState(_))
    ));

    // A repair that fails leaves the cache poisoned and reports its error.
    let refused = cache.recover(|c| {
        if c.last() == Some(&99) {
            Err(CacheError::InvalidArgument("half-done pass".into()))
        } else {
            Ok(())
        }
    });
    assert_eq!(refused, Err(CacheError::InvalidArgument("half-done pass".into())));
    assert!(cache.is_poisoned());

    let popped = cache.recover(|c| Ok(c.pop())).unwrap();
    assert_eq!(popped, Some(99));
    assert!(!cache.is_poisoned());
    assert_eq!(*cache.lock().unwrap(), vec![1, 2, 3]);
}

#[test]
fn try_lock_never_blocks() {
    let cache = Shared::new(0u64);
    let held: SharedGuard<'_, u64> = cache.lock().unwrap();
    let other = cache.clone();
    let busy = thread::spawn(move || other.try_lock().unwrap().is_none())
        .join()
        .unwrap();
    assert!(busy, "try_lock got a cache another thread holds");
    drop(held);
    *cache.try_lock().unwrap().expect("free now") += 5;
    assert_eq!(cache.with(|c| *c).unwrap(), 5);
}

#[test]
fn handles_and_ownership() {
    let a = Shared::from(String::from("cache"));
    let b = a.clone();
    assert!(a.same_cache(&b));
    assert!(!a.same_cache(&Shared::default()));
    assert_eq!(a.handles(), 2);
    assert_eq!(format!("{a:?}"), "Shared { handles: 2, poisoned: false, .. }");
    let a = a.into_inner().expect_err("another handle is alive");
    drop(b);
    assert_eq!(a.into_inner().unwrap(), "cache");
}

#[test]
fn handles_are_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Shared<Vec<u8>>>();
    assert_send_sync::<Shared<Box<dyn kvcache_api::SnapshotCache>>>();
}
