//! Block keys and lookups over them: chaining, namespace and model separation,
//! tails, and what `known_prefix` reports.

mod common;

use common::*;
use kvcache_api::Submitted;
use kvcache_api::{Fingerprint, Namespace, PrefixStore};
use kvcache_store::{redis_prefix, BlockKey, KeyChain, Scope};

#[test]
fn keys_chain_over_the_whole_prefix() {
    let ns = Namespace::shared();
    let scope = Scope::new(&FP, &ns);
    let a: Vec<u32> = (0..12).collect();
    let mut b = a.clone();
    b[1] = 99; // differs in block 0 only
    let ka: Vec<BlockKey> = KeyChain::new(scope, 4, &a).map(|(_, k)| k).collect();
    let kb: Vec<BlockKey> = KeyChain::new(scope, 4, &b).map(|(_, k)| k).collect();
    assert_eq!(ka.len(), 3);
    // Block 1 and 2 hold the same tokens, yet their keys differ: the key names
    // the prefix, not the block.
    assert_ne!(ka[1], kb[1]);
    assert_ne!(ka[2], kb[2]);
    assert_eq!(ka[1], BlockKey::new(&scope, &ka[0], &a[4..8]));
    assert_eq!(ka[0], BlockKey::new(&scope, &BlockKey::ROOT, &a[0..4]));
    // A tail's key differs from the full block over a longer list.
    assert_ne!(BlockKey::new(&scope, &ka[0], &a[4..7]), ka[1]);
    // Deterministic, and hex round-trips.
    assert_eq!(KeyChain::new(scope, 4, &a).next().unwrap().1, ka[0]);
    assert_eq!(BlockKey::from_hex(&ka[2].to_hex()), Some(ka[2]));
    assert_eq!(BlockKey::from_hex("xyz"), None);
}

#[test]
fn keys_separate_namespaces_and_models() {
    let tokens: Vec<u32> = (0..4).collect();
    let shared = Namespace::shared();
    let (a, b) = (Namespace::new("a").unwrap(), Namespace::new("ab").unwrap());
    let other = Fingerprint([0x22; 32]);
    let key = |fp: &Fingerprint, ns: &Namespace| BlockKey::new(&Scope::new(fp, ns), &BlockKey::ROOT, &tokens);
    let all = [
        key(&FP, &shared),
        key(&FP, &a),
        key(&FP, &b),
        key(&other, &shared),
        key(&other, &a),
    ];
    for i in 0..all.len() {
        for j in i + 1..all.len() {
            assert_ne!(all[i], all[j], "{i} vs {j}");
        }
    }
    // Length first (key format 2): no tenant's prefix starts another's.
    assert_eq!(redis_prefix(&Scope::new(&FP, &a)), "kvc2:1111111111111111:1:a:");
    assert_eq!(
        redis_prefix(&Scope::new(&FP, &shared)),
        "kvc2:1111111111111111:0::"
    );
    let nested = Namespace::new("a:m").unwrap();
    assert_eq!(
        redis_prefix(&Scope::new(&FP, &nested)),
        "kvc2:1111111111111111:3:a:m:"
    );
}

#[test]
fn a_stored_prompt_comes_back_whole_including_its_tail() {
    // Planned fetches (the tier says what it holds) and block-by-block ones
    // (it does not) give the same answers.
    stored_prompt_comes_back_whole(memory_store(8, 1 << 20));
    stored_prompt_comes_back_whole(opaque_memory_store(8, 1 << 20));
}

fn stored_prompt_comes_back_whole(store: kvcache_store::TieredStore) {
    let ns = Namespace::new("t1").unwrap();
    let tokens = prompt(1, 21); // blocks 0..8, 8..16, tail 16..21
    let kv = kv_of(layout(), &tokens, 0..21);
    assert_eq!(store.submit(&ns, &tokens, kv.clone()), Submitted::Queued);
    store.flush();
    assert_eq!(store.stats().blocks_written, 3);

    let got = store.fetch(&ns, &tokens, 0, SECOND).unwrap();
    assert_eq!(got.kv, kv);
    assert_eq!(store.known_prefix(&ns, &tokens), 21);

    // A longer prompt with the same start gets all 21 stored tokens.
    let mut longer = tokens.clone();
    longer.extend(500..540);
    assert_eq!(store.fetch(&ns, &longer, 0, SECOND).unwrap().kv, kv);
    assert_eq!(store.known_prefix(&ns, &longer), 16);

    // A prompt diverging inside the tail gets the full blocks before it only.
    let mut diverging = tokens.clone();
    diverging[19] = 7;
    let got = store.fetch(&ns, &diverging, 0, SECOND).unwrap();
    assert_eq!(got.kv, kv.slice(0..16).unwrap());
    assert_eq!(store.known_prefix(&ns, &diverging), 16);

    // Diverging inside block 1: block 0 only.
    let mut early = tokens.clone();
    early[9] = 7;
    assert_eq!(
        store.fetch(&ns, &early, 0, SECOND).unwrap().kv,
        kv.slice(0..8).unwrap()
    );
    assert_eq!(store.known_prefix(&ns, &early), 8);

    // Mid-block `from`, inside the tail, and past what is stored.
    assert_eq!(
        store.fetch(&ns, &tokens, 11, SECOND).unwrap().kv,
        kv.slice(11..21).unwrap()
    );
    assert_eq!(
        store.fetch(&ns, &tokens, 18, SECOND).unwrap().kv,
        kv.slice(18..21).unwrap()
    );
    assert!(store.fetch(&ns, &longer, 21, SECOND).is_none());
    assert!(store.fetch(&ns, &tokens, 30, SECOND).is_none());
}

#[test]
fn the_longest_matching_tail_wins() {
    longest_matching_tail_wins(memory_store(8, 1 << 20));
    longest_matching_tail_wins(opaque_memory_store(8, 1 << 20));
}

fn longest_matching_tail_wins(store: kvcache_store::TieredStore) {
    let ns = Namespace::shared();
    let long = prompt(2, 21);
    let short = long[..18].to_vec();
    assert_eq!(
        store.submit(&ns, &short, kv_of(layout(), &short, 0..18)),
        Submitted::Queued
    );
    assert_eq!(
        store.submit(&ns, &long, kv_of(layout(), &long, 0..21)),
        Submitted::Queued
    );
    store.flush();
    let full = kv_of(layout(), &long, 0..21);

    // Matches 20 tokens of the 21 stored: the 2-token tail fits, the 5-token one
    // does not.
    let mut probe = long.clone();
    probe[20] = 1;
    assert_eq!(
        store.fetch(&ns, &probe, 0, SECOND).unwrap().kv,
        full.slice(0..18).unwrap()
    );
    assert_eq!(store.fetch(&ns, &long, 0, SECOND).unwrap().kv, full);
    // A prompt of only 17 tokens fits no tail.
    assert_eq!(
        store.fetch(&ns, &long[..17], 0, SECOND).unwrap().kv,
        full.slice(0..16).unwrap()
    );
    // A prompt shorter than one block matches a root tail only.
    let tiny = prompt(3, 5);
    assert_eq!(
        store.submit(&ns, &tiny, kv_of(layout(), &tiny, 0..5)),
        Submitted::Queued
    );
    store.flush();
    assert_eq!(
        store.fetch(&ns, &tiny, 0, SECOND).unwrap().kv,
        kv_of(layout(), &tiny, 0..5)
    );
    assert_eq!(store.known_prefix(&ns, &tiny), 5);
    assert!(store.fetch(&ns, &tiny[..4], 0, SECOND).is_none());
}

#[test]
fn prefixes_never_cross_namespaces_or_models() {
    let store = memory_store(8, 1 << 20);
    let (a, b) = (
        Namespace::new("tenant-a").unwrap(),
        Namespace::new("tenant-b").unwrap(),
    );
    let tokens = prompt(4, 20);
    assert_eq!(
        store.submit(&a, &tokens, kv_of(layout(), &tokens, 0..20)),
        Submitted::Queued
    );
    store.flush();
    assert!(store.fetch(&a, &tokens, 0, SECOND).is_some());
    assert!(store.fetch(&b, &tokens, 0, SECOND).is_none());
    assert!(store.fetch(&Namespace::shared(), &tokens, 0, SECOND).is_none());
    assert_eq!(store.known_prefix(&b, &tokens), 0);

    // A tier built for another model is refused by the store.
    let other = kvcache_store::StoreConfig::new(Fingerprint([9; 32]), layout()).with_block_tokens(8);
    let tier = kvcache_store::MemoryTier::new(other.context(), 1 << 20);
    let err = kvcache_store::TieredStore::new(config(8), vec![Box::new(tier)]).unwrap_err();
    assert!(err.to_string().contains("fingerprint"), "{err}");
}

#[test]
fn later_runs_extend_earlier_ones() {
    let store = memory_store(8, 1 << 20);
    let ns = Namespace::shared();
    let tokens = prompt(5, 30);
    let full = kv_of(layout(), &tokens, 0..30);
    // The first turn stores 16 tokens, the second the rest from the known prefix.
    assert_eq!(
        store.submit(&ns, &tokens[..16], full.slice(0..16).unwrap()),
        Submitted::Queued
    );
    store.flush();
    let known = store.known_prefix(&ns, &tokens);
    assert_eq!(known, 16);
    assert_eq!(
        store.submit(&ns, &tokens, full.slice(known..30).unwrap()),
        Submitted::Queued
    );
    store.flush();
    assert_eq!(store.known_prefix(&ns, &tokens), 30);
    let got = store.fetch(&ns, &tokens, 0, SECOND).unwrap();
    assert_eq!(got.kv, full);
    assert_eq!(got.tiers, vec![("memory", 30)]);
}

#[test]
fn bad_submissions_are_counted_not_stored() {
    let store = memory_store(8, 1 << 20);
    let ns = Namespace::shared();
    let tokens = prompt(6, 20);
    // Unaligned start, more rows than tokens, another layout.
    assert_eq!(
        store.submit(&ns, &tokens, kv_of(layout(), &tokens, 3..10)),
        Submitted::Rejected
    );
    assert_eq!(
        store.submit(&ns, &tokens[..10], kv_of(layout(), &tokens, 0..20)),
        Submitted::Rejected
    );
    let other = kvcache_api::KvLayout::new(1, 1, 2, kvcache_api::DType::F32);
    assert_eq!(
        store.submit(&ns, &tokens, kv_of(other, &tokens, 0..8)),
        Submitted::Rejected
    );
    store.flush();
    let stats = store.stats();
    assert_eq!((stats.rejected, stats.submitted, stats.blocks_written), (3, 0, 0));
    assert!(store.fetch(&ns, &tokens, 0, SECOND).is_none());
}
