//! A tiny Llama with random weights behind an engine whose tokenizer spells
//! token `i` as the letter `a + i % 26`, for tests of how requests end.

use std::sync::Arc;

use candle_core::{Device, Tensor};
use kvcache_api::{CausalConfig, KeyShift};
use kvcache_causal::CausalKvCache;
use kvcache_engine::engine::{Engine, EngineConfig};
use kvcache_models::tokenizer::Message;
use kvcache_models::{Llama, LlamaConfig, Tokenizer};

/// Token `i` is the letter `a + i % 26`; no control tokens.
#[derive(Debug)]
pub struct Letters;

impl Tokenizer for Letters {
    fn encode(&self, text: &str) -> kvcache_models::Result<Vec<u32>> {
        Ok(text.bytes().map(|b| u32::from(b - b'a')).collect())
    }
    fn chat_ids(&self, _: &[Message], _: bool) -> kvcache_models::Result<Vec<u32>> {
        Err(kvcache_models::ModelError::InvalidArgument("no template".into()))
    }
    fn decode(&self, ids: &[u32]) -> kvcache_models::Result<String> {
        Ok(ids.iter().map(|&i| char::from(b'a' + (i % 26) as u8)).collect())
    }
    fn decode_text(&self, ids: &[u32]) -> kvcache_models::Result<String> {
        self.decode(ids)
    }
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        vec![b'a' + (id % 26) as u8]
    }
    fn eos_token_id(&self) -> u32 {
        63
    }
    fn end_of_turn_ids(&self) -> Vec<u32> {
        vec![63]
    }
    fn vocab_size(&self) -> usize {
        64
    }
}

/// The tiny Llama (seed 5).
pub fn model() -> Llama {
    Llama::random(LlamaConfig::tiny(), 5, &Device::Cpu).unwrap()
}

/// A cache of 4 sequences of 64 positions with the model's RoPE shift.
pub fn cache(model: &Llama) -> CausalKvCache {
    let shift: Box<dyn KeyShift<Tensor>> = Box::new(model.rope().clone());
    CausalKvCache::new(CausalConfig::new(4, 64, 16), Device::Cpu, Some(shift)).unwrap()
}

/// An engine over `model` and a fresh cache, with `Letters` as its
/// tokenizer and `stop_tokens` ending requests.
pub fn engine(model: &Llama, stop_tokens: Vec<u32>) -> Engine<'_, CausalKvCache> {
    let mut engine = Engine::new(
        model,
        cache(model),
        EngineConfig {
            max_batch: 16,
            prefill_chunk: 4,
            stop_tokens,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    engine.set_tokenizer(Arc::new(Letters));
    engine
}
