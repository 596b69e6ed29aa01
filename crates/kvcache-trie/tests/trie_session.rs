//! A session cannot close silently with a shorter path than it was told about:
//! every recorded token but the last must be evaluated, and `decode` records and
//! evaluates in one step.

use kvcache_api::{CacheError, SnapshotCache};
use kvcache_trie::fake::{feed_all, Counters, FakeKv, FakeLayer};
use kvcache_trie::PrefixCache;

fn trie() -> PrefixCache<FakeKv> {
    let counters = Counters::new();
    PrefixCache::new(vec![FakeKv::new(&counters), FakeKv::new(&counters)], usize::MAX).unwrap()
}

fn eval(tokens: &[u32], caches: &mut [FakeKv]) -> Result<(), CacheError> {
    feed_all(caches, tokens);
    Ok(())
}

const PROMPT: [u32; 4] = [1, 2, 3, 4];

#[test]
fn the_last_recorded_token_may_stay_unevaluated() {
    let mut trie = trie();
    let mut s = trie.begin(&PROMPT).unwrap();
    s.prefill(eval).unwrap();
    s.record(7);
    feed_all(s.caches_mut(), &[7]);
    s.record(8);
    s.close().unwrap();
    trie.check();
    assert_eq!(trie.lookup(&[1, 2, 3, 4, 7, 8, 9]), 5);
}

#[test]
fn recorded_tokens_left_unevaluated_are_reported_at_close() {
    let mut trie = trie();
    let mut s = trie.begin(&PROMPT).unwrap();
    s.prefill(eval).unwrap();
    s.record(7);
    s.record(8); // 7 was never fed
    s.record(9);
    let error = s.close().unwrap_err();
    let CacheError::InvalidState(message) = &error else {
        panic!("not InvalidState: {error:?}");
    };
    assert!(message.contains("hold 4 tokens"), "{message}");
    assert!(message.contains("are 7"), "{message}");
    assert!(message.contains("4..6"), "{message}");
    // The trie stays consistent and keeps what the caches hold: the prompt.
    trie.check();
    assert_eq!(trie.lookup(&[1, 2, 3, 4, 7, 8]), 4);
    assert!(trie.caches().iter().all(|c| c.offset() == 4));
}

#[test]
fn a_token_recorded_mid_prompt_is_reported() {
    let mut trie = trie();
    let mut s = trie.begin(&PROMPT).unwrap();
    feed_all(s.caches_mut(), &[1, 2]);
    s.record(7);
    assert!(matches!(s.close(), Err(CacheError::InvalidState(_))));
    trie.check();
    assert_eq!(trie.lookup(&PROMPT), 2);
}

#[test]
fn an_abandoned_prefill_closes_quietly() {
    let mut trie = trie();
    let mut s = trie.begin(&PROMPT).unwrap();
    feed_all(s.caches_mut(), &[1, 2]);
    s.close().unwrap();
    trie.check();
    assert_eq!(trie.lookup(&PROMPT), 2);
}

#[test]
fn a_dropped_session_left_behind_keeps_the_trie_consistent() {
    let mut trie = trie();
    {
        let mut s = trie.begin(&PROMPT).unwrap();
        s.prefill(eval).unwrap();
        s.record(7);
        s.record(8);
    }
    trie.check();
    assert_eq!(trie.lookup(&[1, 2, 3, 4, 7]), 4);
}

#[test]
fn decode_records_and_evaluates() {
    let mut trie = trie();
    let mut s = trie.begin(&PROMPT).unwrap();
    s.prefill(eval).unwrap();
    for token in [7, 8] {
        let out = s
            .decode(token, |tokens, caches| {
                feed_all(caches, tokens);
                Ok::<usize, CacheError>(tokens.len())
            })
            .unwrap();
        assert_eq!(out, 1, "decode returns what eval returned");
        s.check();
    }
    s.record(9);
    assert_eq!(s.generated(), &[7, 8, 9]);
    s.close().unwrap();
    trie.check();
    assert!(trie.caches().iter().all(|c| c.holds(&[1, 2, 3, 4, 7, 8])));
    assert_eq!(trie.lookup(&[1, 2, 3, 4, 7, 8, 9]), 6);
}

#[test]
fn decode_refuses_caches_off_the_known_end() {
    let mut trie = trie();
    let mut s = trie.begin(&PROMPT).unwrap();
    feed_all(s.caches_mut(), &[1, 2, 3]);
    let e = s.decode(7, eval).unwrap_err();
    assert!(matches!(e, CacheError::InvalidState(_)), "{e:?}");
    assert!(s.generated().is_empty(), "nothing recorded");
    // An eval that evaluates nothing is reported, and so is the gap at close.
    feed_all(s.caches_mut(), &[4]);
    let e = s.decode(7, |_, _| Ok::<(), CacheError>(())).unwrap_err();
    assert!(matches!(e, CacheError::InvalidState(_)), "{e:?}");
    s.record(8);
    assert!(s.close().is_err());
    trie.check();
    // An error of eval comes back as it is.
    let mut s = trie.begin(&[1, 2, 3, 4, 5]).unwrap();
    s.prefill(eval).unwrap();
    let e = s
        .decode(7, |_, _| Err::<(), _>(CacheError::Backend("device lost".into())))
        .unwrap_err();
    assert_eq!(e, CacheError::Backend("device lost".into()));
}
