//! The prefix trie over real mlx-rs layer caches: random conversations (new,
//! extend, branch, switch back) under a small byte budget, checking after every
//! request that the live arrays hold exactly the keys and values a from-scratch
//! evaluation of the cached prefix would hold.
#![cfg(any(target_os = "macos", kvcache_mlx))]

mod layers_common;

use kvcache_api::{CacheError, LayerCache};
use kvcache_mlx::layers::KvCache;
use kvcache_trie::PrefixCache;
use layers_common::{ids_of, SMALL};
use proptest::prelude::*;

/// The model's forward pass over real arrays: every token writes keys/values
/// that encode its id.
fn eval(caches: &mut [KvCache], tokens: &[u32]) -> Result<(), CacheError> {
    let (k, v) = SMALL.kv(tokens);
    for cache in caches {
        cache.update(&k, &v)?;
    }
    Ok(())
}

/// Token ids each live cache holds, read back from its arrays.
fn live_ids(cache: &KvCache) -> Vec<u32> {
    match cache.live().unwrap() {
        Some((k, v)) => ids_of(&k, &v),
        None => vec![],
    }
}

#[derive(Debug, Clone)]
enum Request {
    /// A new conversation of `len` fresh tokens.
    New(usize),
    /// Continue conversation `conv` (modulo the count) with `len` more tokens.
    Extend(usize, usize),
    /// Branch conversation `conv` at `at` (fraction in 0..100) with `len` tokens.
    Branch(usize, u8, usize),
    /// Repeat conversation `conv` exactly.
    Repeat(usize),
}

fn request() -> impl Strategy<Value = Request> {
    prop_oneof![
        (1usize..12).prop_map(Request::New),
        (0usize..8, 1usize..8).prop_map(|(c, l)| Request::Extend(c, l)),
        (0usize..8, 0u8..100, 1usize..6).prop_map(|(c, a, l)| Request::Branch(c, a, l)),
        (0usize..8).prop_map(Request::Repeat),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn restored_arrays_equal_recomputation(
        requests in prop::collection::vec(request(), 1..14),
        budget in prop_oneof![Just(0usize), Just(SMALL.bytes(12)), Just(usize::MAX)],
        generated in 0usize..3,
    ) {
        let layers = vec![KvCache::with_step(4).unwrap(), KvCache::with_step(4).unwrap()];
        let mut cache = PrefixCache::new(layers, budget).unwrap();
        let mut conversations: Vec<Vec<u32>> = vec![];
        let mut next_id = 1u32;
        let mut fresh = |n: usize| {
            let ids: Vec<u32> = (next_id..next_id + n as u32).collect();
            next_id += n as u32;
            ids
        };
        for request in requests {
            let prompt = match (&request, conversations.len()) {
                (Request::New(len), _) => {
                    conversations.push(fresh(*len));
                    conversations.len() - 1
                }
                (_, 0) => {
                    conversations.push(fresh(3));
                    conversations.len() - 1
                }
                (Request::Extend(c, len), n) => {
                    let tokens = fresh(*len);
                    conversations[c % n].extend(tokens);
                    c % n
                }
                (Request::Branch(c, at, len), n) => {
                    let base = &conversations[c % n];
                    let cut = base.len() * *at as usize / 100;
                    let mut branch = base[..cut].to_vec();
                    branch.extend(fresh(*len));
                    conversations.push(branch);
                    conversations.len() - 1
                }
                (Request::Repeat(c), n) => c % n,
            };
            let tokens = conversations[prompt].clone();
            let mut session = cache.begin(&tokens).unwrap();
            let cached = session.cached();
            prop_assert!(cached < tokens.len(), "at least one token is evaluated");
            // What the live arrays hold after paging in is the cached prefix.
            for layer in session.caches() {
                prop_assert_eq!(live_ids(layer), tokens[..cached].to_vec());
            }
            session.prefill(|chunk, caches| eval(caches, chunk)).unwrap();
            for layer in session.caches() {
                prop_assert_eq!(live_ids(layer), tokens.clone());
            }
            // Generate: record every token, evaluate all but the last.
            let out = fresh(generated);
            for (i, &t) in out.iter().enumerate() {
                session.record(t);
                if i + 1 < out.len() {
                    eval(session.caches_mut(), &[t]).unwrap();
                }
            }
            session.close().unwrap();
            cache.check();
            // The conversation continues from what the caches evaluated.
            if out.len() > 1 {
                conversations[prompt].extend(&out[..out.len() - 1]);
            }
        }
    }
}
