//! A prefix trie over a model with two kinds of layers (Gemma 3's pattern:
//! window layers with a global layer among them), each layer a `MixedLayer`.

mod trie_support;

use kvcache_api::{CacheError, MixedLayer, SnapshotCache};
use kvcache_trie::fake::{Counters, FakeKv, FakeWindow};
use kvcache_trie::PrefixCache;
use trie_support::{assert_holds, request_with, Options};

const WINDOW: usize = 4;

type Layer = MixedLayer<FakeKv, FakeWindow>;

/// Five window layers, then a global one, twice (Gemma 3's 5:1 pattern).
fn gemma_like(counters: &Counters) -> Vec<Layer> {
    (0..12)
        .map(|i| {
            if i % 6 == 5 {
                MixedLayer::Global(FakeKv::new(counters))
            } else {
                MixedLayer::Window(FakeWindow::new(counters, WINDOW))
            }
        })
        .collect()
}

/// Turn `t` of conversation `c`: the conversation so far plus a new user turn
/// of 3 tokens, then 2 generated tokens.
fn turn(history: &mut Vec<u32>, c: u32, t: u32) -> (Vec<u32>, Vec<u32>) {
    history.extend((0..3).map(|i| 1000 * (c + 1) + 10 * t + i));
    let generated = vec![1000 * (c + 1) + 10 * t + 7, 1000 * (c + 1) + 10 * t + 8];
    (history.clone(), generated)
}

#[test]
fn interleaved_conversations_resume_far_past_the_window() {
    let counters = Counters::new();
    let mut trie = PrefixCache::new(gemma_like(&counters), usize::MAX).unwrap();
    let mut histories = [Vec::new(), Vec::new()];
    for t in 0..8 {
        for (c, history) in histories.iter_mut().enumerate() {
            let before = history.len();
            let (prompt, generated) = turn(history, c as u32, t);
            // A chat engine snapshots the end of each prompt: the next turn
            // replaces the reply that follows it.
            let options = Options {
                user_snapshot: true,
                ..Options::default()
            };
            let out = request_with(&mut trie, &counters, &prompt, &generated, options);
            // Each conversation resumes exactly where its previous prompt
            // ended, although it grows to 6 windows and the other
            // conversation ran in between: the window layers restore their
            // snapshot at that point, the global layers their rows.
            assert_eq!(out.cached, before, "conversation {c} turn {t}");
            assert_eq!(out.remaining, prompt[before..]);
        }
    }
    assert!(
        histories[0].len() >= 6 * WINDOW,
        "conversations outgrow the window"
    );
    assert_holds(trie.caches(), &trie_prompt_end(&histories[1]));
}

fn trie_prompt_end(history: &[u32]) -> Vec<u32> {
    let mut stored = history.to_vec();
    let last_turn = *history.last().unwrap() - 2;
    stored.push(last_turn + 7);
    stored
}

#[test]
fn a_snapshot_of_one_kind_is_foreign_to_the_other() {
    let counters = Counters::new();
    let mut layers = gemma_like(&counters);
    for layer in &mut layers {
        kvcache_trie::fake::FakeLayer::feed(layer, &[1, 2, 3, 4, 5, 6]);
    }
    let window_snapshot = layers[0].snapshot(0).unwrap().expect("a window state");
    let global_snapshot = layers[5].snapshot(0).unwrap().expect("rows");
    assert!(layers[0].is_window() && !layers[5].is_window());
    // A window layer's snapshot holds only the window; the global one all rows.
    assert!(window_snapshot.size_bytes() < global_snapshot.size_bytes());
    let before = layers[5].offset();
    let err = layers[5].restore(Some(window_snapshot.as_ref()), 6).unwrap_err();
    assert!(matches!(err, CacheError::InvalidArgument(_)), "{err:?}");
    assert_eq!(layers[5].offset(), before, "the failed restore changed nothing");
    assert!(layers[0].restore(Some(window_snapshot.as_ref()), 6).unwrap());
    assert!(layers[5].restore(Some(global_snapshot.as_ref()), 6).unwrap());
}
