//! The [`SnapshotCache`] contract as test functions, written once and run
//! for every implementation (feature `contract-tests`).
//!
//! A backend's test describes its cache as a [`Subject`] (how to make one,
//! how the model feeds it tokens, how to tell which tokens it holds) and
//! calls [`row_cache`] (a KV cache: rewinds anywhere, snapshots hold rows) or
//! [`state_cache`] (a window or a recurrent state: snapshots hold the whole
//! state). Each function panics with a message naming the broken rule.
//!
//! Tokens are ids from 1 to 99, so a subject can encode them in `f32`
//! exactly.

use std::any::Any;
use std::ops::Range;

use crate::paging::Rewind;
use crate::{BoxedSnapshot, CacheError, HostKv, KvLayout, Result, Snapshot, SnapshotCache};

/// A cache implementation under test.
pub trait Subject {
    /// The cache.
    type Cache: SnapshotCache;

    /// A new, empty cache.
    fn cache(&self) -> Self::Cache;

    /// Evaluates `tokens` on `cache`, as the model would.
    fn feed(&self, cache: &mut Self::Cache, tokens: &[u32]);

    /// Whether `cache` holds exactly what evaluating `tokens` on an empty
    /// cache gives (its offset included).
    fn holds(&self, cache: &Self::Cache, tokens: &[u32]) -> bool;

    /// Bytes a row snapshot keeps per token (row caches only).
    fn bytes_per_token(&self) -> usize {
        0
    }

    /// The host layout of one layer of this cache's rows, for a cache that
    /// reads and appends host rows.
    fn host_layout(&self) -> Option<KvLayout> {
        None
    }
}

/// A snapshot no cache knows.
#[derive(Debug)]
pub struct Foreign(pub Range<usize>);

impl Snapshot for Foreign {
    fn range(&self) -> Range<usize> {
        self.0.clone()
    }
    fn size_bytes(&self) -> usize {
        0
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

/// Tokens `from..to` (ids from 1).
fn ids(range: Range<u32>) -> Vec<u32> {
    range.collect()
}

/// A cache holding `tokens`.
fn holding<S: Subject>(s: &S, tokens: &[u32]) -> S::Cache {
    let mut cache = s.cache();
    s.feed(&mut cache, tokens);
    assert!(s.holds(&cache, tokens), "a cache fed {tokens:?} holds them");
    cache
}

fn snap<C: SnapshotCache>(cache: &mut C, from: usize) -> BoxedSnapshot {
    match cache.snapshot(from) {
        Ok(Some(s)) => s,
        Ok(None) => panic!("snapshot({from}) at offset {} gave none", cache.offset()),
        Err(e) => panic!("snapshot({from}) failed: {e}"),
    }
}

fn invalid<T>(r: Result<T>, what: &str) {
    match r {
        Err(CacheError::InvalidArgument(_)) => {}
        Err(e) => panic!("{what}: expected InvalidArgument, got {e}"),
        Ok(_) => panic!("{what}: expected InvalidArgument, got Ok"),
    }
}

/// The rules every snapshot cache keeps: nothing to snapshot when empty or
/// at the offset, snapshots leave the live cache as it was and restore at
/// their end over anything, foreign and non-consecutive snapshots are
/// `InvalidArgument` errors that change nothing, free empties the cache.
pub fn common<S: Subject>(s: &S) {
    let mut cache = s.cache();
    assert_eq!(cache.offset(), 0);
    assert!(cache.snapshot(0).unwrap().is_none(), "empty: nothing to snapshot");

    let a = ids(1..7);
    let mut cache = holding(s, &a);
    assert!(cache.snapshot(6).unwrap().is_none(), "nothing past the offset");
    assert!(cache.snapshot(9).unwrap().is_none(), "nothing past the offset");
    let whole = snap(&mut cache, 0);
    let tail = snap(&mut cache, 4);
    assert_eq!((whole.range(), tail.range()), (0..6, 4..6));
    assert!(s.holds(&cache, &a), "snapshots leave the live cache as it was");

    // Diverge, then restore at the snapshot's end: over another state, and
    // into a new cache.
    assert!(cache.restore(None, 0).unwrap(), "every cache rewinds to 0");
    assert!(s.holds(&cache, &[]));
    let b = ids(20..29);
    s.feed(&mut cache, &b);
    assert!(cache.restore(Some(&*whole), 6).unwrap());
    assert!(s.holds(&cache, &a), "restored at the snapshot's end");
    let mut fresh = s.cache();
    assert!(fresh.restore(Some(&*whole), 6).unwrap());
    assert!(s.holds(&fresh, &a), "restored into an empty cache");
    assert!(
        !cache.restore(Some(&*whole), 7).unwrap(),
        "past the snapshot's end"
    );
    assert!(s.holds(&cache, &a));

    // Foreign snapshots change nothing.
    invalid(
        cache.restore(Some(&Foreign(0..6)), 6),
        "restore of a foreign snapshot",
    );
    let (mine, foreign) = (snap(&mut cache, 0), Box::new(Foreign(6..8)));
    invalid(
        cache.merge(Some(mine), Some(foreign)),
        "merge with a foreign child",
    );
    let (foreign, mine) = (Box::new(Foreign(0..4)), snap(&mut cache, 4));
    invalid(
        cache.merge(Some(foreign), Some(mine)),
        "merge with a foreign parent",
    );
    invalid(
        cache.split(Box::new(Foreign(0..6)), 3),
        "split of a foreign snapshot",
    );
    // Snapshots that are not consecutive do not merge.
    invalid(cache.merge(Some(whole), Some(tail)), "merge of [0, 6) and [4, 6)");
    assert!(s.holds(&cache, &a), "rejected calls change nothing");
    assert!(cache.merge(None, None).unwrap().is_none());
    let parent = snap(&mut cache, 2);
    assert!(
        cache.merge(Some(parent), None).unwrap().is_none(),
        "no child, no merge"
    );

    cache.free();
    assert_eq!(cache.offset(), 0);
    assert!(s.holds(&cache, &[]), "free empties the cache");
    assert!(cache.snapshot(0).unwrap().is_none());
    s.feed(&mut cache, &b);
    assert!(s.holds(&cache, &b), "a freed cache is used again");
}

/// [`common`], then the rules of a row cache (a KV cache): it rewinds to any
/// earlier offset; a snapshot `[a, b)` restores over a cache holding `[0, a)`,
/// to any target up to `b`, and keeps `b - a` rows' bytes; merge
/// concatenates consecutive snapshots (none without both), split cuts them;
/// host rows, where the cache takes them, go out and back in unchanged.
pub fn row_cache<S: Subject>(s: &S) {
    common(s);
    let a = ids(1..11);
    let mut cache = holding(s, &a);
    let per_token = s.bytes_per_token();
    assert!(!cache.holds_whole_state(), "a row cache's snapshots hold rows");

    // Live rewinds.
    assert!(!cache.restore(None, 11).unwrap(), "a rewind cannot go forward");
    assert!(cache.restore(None, 7).unwrap());
    assert!(s.holds(&cache, &a[..7]));
    s.feed(&mut cache, &a[7..]);

    // A snapshot of its rows only.
    let upper = snap(&mut cache, 3);
    assert_eq!(
        upper.size_bytes(),
        7 * per_token,
        "a snapshot keeps its rows' bytes"
    );
    assert!(cache.restore(None, 2).unwrap());
    assert!(
        !cache.restore(Some(&*upper), 8).unwrap(),
        "[3, 10) needs [0, 3) live"
    );
    assert!(s.holds(&cache, &a[..2]), "an unreachable restore changes nothing");
    s.feed(&mut cache, &[a[2], 90, 91]);
    assert!(
        cache.restore(Some(&*upper), 8).unwrap(),
        "a target inside the snapshot"
    );
    assert!(s.holds(&cache, &a[..8]));
    assert!(
        cache.restore(Some(&*upper), 2).unwrap(),
        "a target before it rewinds"
    );
    assert!(s.holds(&cache, &a[..2]));

    // Split and merge.
    s.feed(&mut cache, &a[2..]);
    let (p, c) = cache.split(upper, 6).unwrap();
    let (p, c) = (p.expect("upper half"), c.expect("lower half"));
    assert_eq!((p.range(), c.range()), (3..6, 6..10));
    assert_eq!((p.size_bytes(), c.size_bytes()), (3 * per_token, 4 * per_token));
    assert!(cache.restore(None, 3).unwrap());
    assert!(cache.restore(Some(&*p), 6).unwrap());
    assert!(cache.restore(Some(&*c), 10).unwrap());
    assert!(s.holds(&cache, &a), "the halves restore one after the other");
    let merged = cache.merge(Some(p), Some(c)).unwrap().expect("both halves");
    assert_eq!((merged.range(), merged.size_bytes()), (3..10, 7 * per_token));
    assert!(cache.restore(None, 3).unwrap());
    assert!(cache.restore(Some(&*merged), 10).unwrap());
    assert!(s.holds(&cache, &a), "the merged snapshot restores both");
    let (none, whole) = cache.split(merged, 3).unwrap();
    assert!(none.is_none(), "split at the start: nothing above");
    let (whole, none) = cache.split(whole.expect("whole"), 12).unwrap();
    assert!(none.is_none(), "split past the end: nothing below");
    assert_eq!(whole.expect("whole").range(), 3..10);
    let lone = snap(&mut cache, 5);
    assert!(
        cache.merge(None, Some(lone)).unwrap().is_none(),
        "rows need their parent"
    );

    if let Some(layout) = s.host_layout() {
        host_rows(s, layout, &a);
    }
}

/// Host rows `[4, 10)` of a cache holding `a` go into a cache holding
/// `a[..4]` and make it hold `a`; rows that are not live are refused.
fn host_rows<S: Subject>(s: &S, layout: KvLayout, a: &[u32]) {
    let source = holding(s, a);
    let mut kv = HostKv::zeroed(layout, 4, 6);
    assert!(
        source.read_rows(4..10, kv.layer_mut(0)).unwrap(),
        "live rows are read"
    );
    let mut target = holding(s, &a[..4]);
    assert!(
        target.append_rows(kv.layer(0), 0..6).unwrap(),
        "rows are appended"
    );
    assert!(s.holds(&target, a), "host rows round-trip");
    let mut beyond = HostKv::zeroed(layout, 8, 4);
    assert!(
        !source.read_rows(8..12, beyond.layer_mut(0)).unwrap(),
        "rows past the offset"
    );
    assert!(s.holds(&source, a));
}

/// [`common`], then the rules of a state cache rewinding as `rewind` says (a
/// window of `W >= 4`, or a recurrent state): snapshots hold the whole state
/// and restore at their end (a window's, before it wraps, at any earlier
/// target too); merge keeps the child, with or without a parent; split is
/// refused.
pub fn state_cache<S: Subject>(s: &S, rewind: Rewind) {
    common(s);
    let a = ids(1..4);
    let mut cache = holding(s, &a);
    assert!(
        cache.holds_whole_state(),
        "a state cache's snapshots hold its whole state"
    );
    let parent = snap(&mut cache, 0);
    let b = ids(4..12);
    s.feed(&mut cache, &b);
    let all = [&a[..], &b[..]].concat();
    let child = snap(&mut cache, 3);

    // Rewinds without a snapshot.
    assert!(!cache.restore(None, 12).unwrap(), "a rewind cannot go forward");
    assert!(
        cache.restore(None, 11).unwrap(),
        "a rewind to the offset is nothing to do"
    );
    let wrapped = matches!(rewind, Rewind::Window(w) if w < 11);
    let rewound = cache.restore(None, 10).unwrap();
    let expected = !wrapped && rewind != Rewind::Never;
    assert_eq!(rewound, expected, "a rewind inside the state ({rewind:?})");
    if rewound {
        assert!(s.holds(&cache, &all[..10]));
        s.feed(&mut cache, &all[10..]);
    }
    assert!(s.holds(&cache, &all), "a refused rewind changes nothing");

    // Restores: at the end always, earlier only inside a window that holds all.
    assert!(cache.restore(Some(&*child), 11).unwrap());
    assert!(s.holds(&cache, &all));
    assert!(
        !cache.restore(Some(&*child), 12).unwrap(),
        "past the snapshot's end"
    );
    let early = Rewind::reaches(rewind, 3, 2);
    assert_eq!(
        cache.restore(Some(&*parent), 2).unwrap(),
        early,
        "inside [0, 3) ({rewind:?})"
    );
    if early {
        assert!(s.holds(&cache, &a[..2]));
    }

    // Merge keeps the child; split is refused.
    let merged = cache
        .merge(Some(parent), Some(child))
        .unwrap()
        .expect("the child");
    assert_eq!(merged.range(), 0..11, "the child over both ranges");
    assert!(cache.restore(Some(&*merged), 11).unwrap());
    assert!(s.holds(&cache, &all), "the merged snapshot is the child's state");
    let (none, kept) = cache.split(merged, 5).unwrap();
    assert!(none.is_none(), "a whole state does not split");
    let kept = kept.expect("the snapshot back");
    assert_eq!(kept.range(), 0..11);
    let lone = snap(&mut cache, 7);
    let alone = cache
        .merge(None, Some(lone))
        .unwrap()
        .expect("the child without a parent");
    assert_eq!(alone.range(), 7..11);
    cache.free();
    assert!(cache.restore(Some(&*alone), 11).unwrap());
    assert!(s.holds(&cache, &all), "a child kept alone restores its state");
}
