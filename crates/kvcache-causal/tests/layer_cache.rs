//! The candle layer cache (`CandleKv`) keeps the SnapshotCache contract
//! (`kvcache_api::contract`) that kvcache-mlx's KV cache keeps, so the prefix
//! trie drives it the same way.

use candle_core::{Device, Tensor};
use kvcache_api::contract::{row_cache, Subject};
use kvcache_api::{DType, KvLayout, LayerCache, SnapshotCache};
use kvcache_causal::layer_cache::CandleKv;

const HEADS: usize = 2;
const HEAD_DIM: usize = 3;

/// Key element (head `h`, dim `d`) of token `id`; its value is the negation.
fn code(id: u32, h: usize, d: usize) -> f32 {
    (id as usize * 100 + h * 10 + d) as f32
}

/// `CandleKv` on the CPU, fed keys and values that encode each token's id.
struct Candle;

impl Subject for Candle {
    type Cache = CandleKv;

    fn cache(&self) -> CandleKv {
        CandleKv::new(HEADS, HEAD_DIM, &Device::Cpu)
    }

    /// Keys and values `[1, HEADS, tokens, HEAD_DIM]`.
    fn feed(&self, cache: &mut CandleKv, tokens: &[u32]) {
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
        cache.update(&keys, &values).unwrap();
    }

    fn holds(&self, cache: &CandleKv, tokens: &[u32]) -> bool {
        if cache.offset() != tokens.len() {
            return false;
        }
        let state = cache.state();
        let [keys, values] = &state[..] else {
            return tokens.is_empty();
        };
        let keys = keys.to_vec3::<f32>().unwrap();
        let values = values.to_vec3::<f32>().unwrap();
        (0..HEADS).all(|h| {
            tokens.iter().enumerate().all(|(i, &id)| {
                (0..HEAD_DIM).all(|d| keys[h][i][d] == code(id, h, d) && values[h][i][d] == -code(id, h, d))
            })
        })
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
