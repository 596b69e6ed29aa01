//! The candle layer caches keep the SnapshotCache contract
//! (`kvcache_api::contract`) that kvcache-mlx's caches keep, so the prefix
//! trie drives them the same way: `CandleKv` as a row cache, `CandleWindow`
//! as a state cache with a window.

use candle_core::{Device, Tensor};
use kvcache_api::contract::{row_cache, state_cache, Subject};
use kvcache_api::paging::Rewind;
use kvcache_api::{DType, KvLayout, LayerCache, MixedLayer, SnapshotCache};
use kvcache_causal::layer_cache::{CandleKv, CandleWindow};

const HEADS: usize = 2;
const HEAD_DIM: usize = 3;

/// Key element (head `h`, dim `d`) of token `id`; its value is the negation.
fn code(id: u32, h: usize, d: usize) -> f32 {
    (id as usize * 100 + h * 10 + d) as f32
}

/// Keys and values `[1, HEADS, tokens, HEAD_DIM]` that encode each token's id.
fn coded(tokens: &[u32]) -> (Tensor, Tensor) {
    let mut keys = Vec::new();
    for h in 0..HEADS {
        for &id in tokens {
            keys.extend((0..HEAD_DIM).map(|d| code(id, h, d)));
        }
    }
    let values: Vec<f32> = keys.iter().map(|k| -k).collect();
    let shape = (1, HEADS, tokens.len(), HEAD_DIM);
    let keys = Tensor::from_vec(keys, shape, &Device::Cpu).unwrap();
    let values = Tensor::from_vec(values, shape, &Device::Cpu).unwrap();
    (keys, values)
}

/// Whether `state`, keys then values `[HEADS, n, HEAD_DIM]`, are the codes of
/// `tokens` in order (nothing at all for no tokens).
fn state_is(state: &[Tensor], tokens: &[u32]) -> bool {
    let [keys, values] = state else {
        return state.is_empty() && tokens.is_empty();
    };
    let keys = keys.to_vec3::<f32>().unwrap();
    let values = values.to_vec3::<f32>().unwrap();
    (0..HEADS).all(|h| {
        keys[h].len() == tokens.len()
            && tokens.iter().enumerate().all(|(i, &id)| {
                (0..HEAD_DIM).all(|d| keys[h][i][d] == code(id, h, d) && values[h][i][d] == -code(id, h, d))
            })
    })
}

/// `CandleKv` on the CPU, fed keys and values that encode each token's id.
struct Candle;

impl Subject for Candle {
    type Cache = CandleKv;

    fn cache(&self) -> CandleKv {
        CandleKv::new(HEADS, HEAD_DIM, &Device::Cpu)
    }

    fn feed(&self, cache: &mut CandleKv, tokens: &[u32]) {
        let (keys, values) = coded(tokens);
        cache.update(&keys, &values).unwrap();
    }

    fn holds(&self, cache: &CandleKv, tokens: &[u32]) -> bool {
        cache.offset() == tokens.len() && state_is(&cache.state(), tokens)
    }

    fn bytes_per_token(&self) -> usize {
        2 * HEADS * HEAD_DIM * 4
    }

    fn host_layout(&self) -> Option<KvLayout> {
        Some(KvLayout::new(1, HEADS, HEAD_DIM, DType::F32))
    }
}

#[test]
fn candle_kv_keeps_the_row_cache_contract() {
    row_cache(&Candle);
}

#[test]
fn a_snapshot_of_another_shape_is_refused_and_changes_nothing() {
    let mut cache = Candle.cache();
    Candle.feed(&mut cache, &[1, 2, 3]);
    let mut wide = CandleKv::new(HEADS + 1, HEAD_DIM, &Device::Cpu);
    let keys = Tensor::zeros((1, HEADS + 1, 2, HEAD_DIM), candle_core::DType::F32, &Device::Cpu).unwrap();
    wide.update(&keys, &keys).unwrap();
    let theirs = wide.snapshot(0).unwrap().expect("two rows");
    assert!(cache.restore(None, 0).unwrap());
    assert!(cache.restore(Some(&*theirs), 2).is_err());
    assert!(Candle.holds(&cache, &[]));
}

/// `CandleWindow` of `W` positions on the CPU, fed keys and values that encode
/// each token's id; it holds the last `W` of them.
struct Window(usize);

impl Subject for Window {
    type Cache = CandleWindow;

    fn cache(&self) -> CandleWindow {
        CandleWindow::new(self.0, HEADS, HEAD_DIM, &Device::Cpu).unwrap()
    }

    fn feed(&self, cache: &mut CandleWindow, tokens: &[u32]) {
        let (keys, values) = coded(tokens);
        cache.update(&keys, &values).unwrap();
    }

    fn holds(&self, cache: &CandleWindow, tokens: &[u32]) -> bool {
        let kept = &tokens[tokens.len().saturating_sub(self.0)..];
        cache.offset() == tokens.len() && state_is(&cache.state(), kept)
    }
}

#[test]
fn candle_window_keeps_the_state_cache_contract() {
    for window in [4, 16] {
        state_cache(&Window(window), Rewind::Window(window));
    }
}

#[test]
fn a_mixed_layer_answers_for_the_cache_it_holds() {
    // What a prefix trie over Gemma's layers asks to know which snapshots a
    // child's supersede.
    type Layer = MixedLayer<CandleKv, CandleWindow>;
    let global: Layer = MixedLayer::Global(Candle.cache());
    let window: Layer = MixedLayer::Window(Window(4).cache());
    assert!(!global.holds_whole_state());
    assert!(window.holds_whole_state());
}

#[test]
fn a_window_update_returns_what_the_new_tokens_attend_to() {
    let mut cache = Window(4).cache();
    // The first update sees only itself; later ones the last W - 1 earlier
    // positions too, in temporal order, however many tokens they bring.
    let (keys, values) = cache.update(&coded(&[1, 2]).0, &coded(&[1, 2]).1).unwrap();
    assert!(state_is(
        &[keys.squeeze(0).unwrap(), values.squeeze(0).unwrap()],
        &[1, 2]
    ));
    let (k, v) = coded(&[3, 4, 5, 6, 7]);
    let (keys, values) = cache.update(&k, &v).unwrap();
    let seen = [keys.squeeze(0).unwrap(), values.squeeze(0).unwrap()];
    assert!(state_is(&seen, &[1, 2, 3, 4, 5, 6, 7]));
    let (k, v) = coded(&[8]);
    let (keys, values) = cache.update(&k, &v).unwrap();
    let seen = [keys.squeeze(0).unwrap(), values.squeeze(0).unwrap()];
    assert!(state_is(&seen, &[5, 6, 7, 8]));
    assert!(Window(4).holds(&cache, &[1, 2, 3, 4, 5, 6, 7, 8]));
    assert_eq!(cache.held_bytes(), 2 * 4 * HEADS * HEAD_DIM * 4);
}

#[test]
fn a_window_refuses_bad_input_and_changes_nothing() {
    assert!(CandleWindow::new(0, HEADS, HEAD_DIM, &Device::Cpu).is_err());
    let mut cache = Window(4).cache();
    Window(4).feed(&mut cache, &[1, 2, 3, 4, 5]);
    let wide = Tensor::zeros((1, HEADS + 1, 2, HEAD_DIM), candle_core::DType::F32, &Device::Cpu).unwrap();
    assert!(cache.update(&wide, &wide).is_err());
    let mut other = CandleWindow::new(4, HEADS + 1, HEAD_DIM, &Device::Cpu).unwrap();
    other.update(&wide, &wide).unwrap();
    let theirs = other.snapshot(0).unwrap().expect("a window");
    assert!(cache.restore(Some(&*theirs), 2).is_err());
    assert!(Window(4).holds(&cache, &[1, 2, 3, 4, 5]));
}
