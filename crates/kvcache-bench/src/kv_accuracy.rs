//! How much a KV storage type costs in accuracy and saves in memory, measured on
//! the real model through [`CausalKvCache`]: the model computes in f32, the cache
//! stores keys and values as f32, f16, bf16 or `q8_0`
//! ([`CausalConfig::with_kv_storage`]).
//!
//! - **Perplexity** over a fixed text, the E1 trace's assistant replies
//!   ([`reference_text`]), evaluated in passes of [`AccuracyPlan::pass_len`]
//!   tokens, so that every pass attends over keys and values read back from the
//!   cache.
//! - **Greedy continuations** of the E1 prompts, compared token by token with
//!   those of f32 storage.
//! - **Bytes per cached token**, from the cache's own accounting
//!   ([`CausalKvCache::storage_bytes_per_cell`]).
//! - **Perplexity of a weight mode** ([`model_perplexity`]): the same text
//!   through any model's own cache, for the model loaded in each
//!   [`kvcache_models::WeightMode`].

use candle_core::{Device, Tensor, D};
use kvcache_api::{CausalConfig, KvStorage, Pos};
use kvcache_causal::CausalKvCache;
use kvcache_engine::engine::greedy;
use kvcache_engine::{EngineError, Result};
use kvcache_models::{BatchToken, ChatTokenizer, Llama, Model};

use crate::trace::Trace;

/// How much to measure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccuracyPlan {
    /// Tokens of the reference text scored (from its start).
    pub text_tokens: usize,
    /// Tokens per forward pass while scoring.
    pub pass_len: usize,
    /// E1 prompts continued greedily (the first turn of the first conversations,
    /// in trace order).
    pub prompts: usize,
    /// Tokens generated per prompt.
    pub new_tokens: usize,
}

impl Default for AccuracyPlan {
    /// 512 tokens of text in passes of 128; 2 prompts of 16 new tokens (what a
    /// test can afford on a small CPU; the recorded figures widen it).
    fn default() -> Self {
        AccuracyPlan {
            text_tokens: 512,
            pass_len: 128,
            prompts: 2,
            new_tokens: 16,
        }
    }
}

/// The measurements of one storage type.
#[derive(Debug, Clone, PartialEq)]
pub struct StorageAccuracy {
    /// The storage type.
    pub storage: KvStorage,
    /// Perplexity of the reference text.
    pub perplexity: f64,
    /// Greedy tokens equal to f32 storage's at the same place, before the first
    /// difference of each prompt, summed over the prompts.
    pub greedy_agree: usize,
    /// Greedy tokens generated with f32 storage, summed over the prompts.
    pub greedy_total: usize,
    /// Bytes of keys and values one cached token takes, all layers.
    pub bytes_per_token: usize,
}

/// The measurements of every storage type, f32 first.
#[derive(Debug, Clone, PartialEq)]
pub struct AccuracyReport {
    /// What was measured.
    pub plan: AccuracyPlan,
    /// One row per storage type, f32 first.
    pub rows: Vec<StorageAccuracy>,
}

impl AccuracyReport {
    /// The f32 row.
    pub fn f32(&self) -> &StorageAccuracy {
        &self.rows[0]
    }

    /// The row of `storage`, if measured.
    pub fn row(&self, storage: KvStorage) -> Option<&StorageAccuracy> {
        self.rows.iter().find(|r| r.storage == storage)
    }

    /// `storage`'s perplexity relative to f32's, minus one (0.01 = 1% higher).
    pub fn perplexity_change(&self, row: &StorageAccuracy) -> f64 {
        row.perplexity / self.f32().perplexity - 1.0
    }

    /// A Markdown table: perplexity and its change, greedy agreement, bytes per
    /// token and the saving against f32.
    pub fn table(&self) -> String {
        let mut out = String::from(
            "| storage | perplexity | vs f32 | greedy tokens equal to f32's | bytes/token | f32 / this |\n\
             |---|---:|---:|---:|---:|---:|\n",
        );
        for r in &self.rows {
            out.push_str(&format!(
                "| {} | {:.4} | {:+.3}% | {}/{} | {} | {:.2}x |\n",
                r.storage,
                r.perplexity,
                100.0 * self.perplexity_change(r),
                r.greedy_agree,
                r.greedy_total,
                r.bytes_per_token,
                self.f32().bytes_per_token as f64 / r.bytes_per_token as f64,
            ));
        }
        out
    }
}

/// The fixed text perplexity is measured on: every assistant reply of the E1
/// trace, conversation by conversation, separated by blank lines.
pub fn reference_text(trace: &Trace) -> String {
    let replies: Vec<&str> = trace
        .conversations
        .iter()
        .flatten()
        .map(|turn| turn.assistant.as_str())
        .collect();
    replies.join("\n\n")
}

/// A one-sequence cache for `tokens` positions storing keys and values as `storage`.
fn cache_for(storage: KvStorage, tokens: usize, pass_len: usize) -> Result<CausalKvCache> {
    let config = CausalConfig::new(1, tokens.max(1), pass_len).with_kv_storage(storage);
    Ok(CausalKvCache::new(config, Device::Cpu, None)?)
}

/// Perplexity of `tokens` (at least 2) as one sequence, evaluated in passes of
/// `pass_len` tokens through a cache storing `storage`, and the cache's bytes per
/// cached token.
pub fn perplexity(
    model: &Llama,
    tokens: &[u32],
    storage: KvStorage,
    pass_len: usize,
) -> Result<(f64, usize)> {
    check_text(tokens, pass_len)?;
    let mut cache = cache_for(storage, tokens.len(), pass_len)?;
    let ppl = perplexity_by(tokens, pass_len, |batch| Ok(model.forward(batch, &mut cache)?))?;
    Ok((ppl, cache.storage_bytes_per_cell()))
}

/// Perplexity of `tokens` (at least 2) through `model`'s own cache (f32 keys
/// and values; window layers keep the whole text), in passes of `pass_len`:
/// what a [`kvcache_models::WeightMode`] costs in accuracy, for any model.
pub fn model_perplexity<M: Model>(model: &M, tokens: &[u32], pass_len: usize) -> Result<f64> {
    check_text(tokens, pass_len)?;
    let config = CausalConfig::new(1, tokens.len(), pass_len);
    let mut cache = model.new_cache(&config, tokens.len(), &Device::Cpu)?;
    perplexity_by(tokens, pass_len, |batch| {
        Ok(model.forward_batch(batch, &mut cache)?)
    })
}

fn check_text(tokens: &[u32], pass_len: usize) -> Result<()> {
    if tokens.len() < 2 || pass_len == 0 {
        return Err(EngineError::InvalidArgument(format!(
            "perplexity needs at least 2 tokens and passes of at least 1, got {} and {pass_len}",
            tokens.len()
        )));
    }
    Ok(())
}

/// `exp` of the mean negative log-likelihood of each next token of `tokens`,
/// the logits `[n, vocab]` of each pass of up to `pass_len` tokens from
/// `forward`.
fn perplexity_by(
    tokens: &[u32],
    pass_len: usize,
    mut forward: impl FnMut(&[BatchToken]) -> Result<Tensor>,
) -> Result<f64> {
    let mut nll = 0f64;
    for start in (0..tokens.len() - 1).step_by(pass_len) {
        let end = (start + pass_len).min(tokens.len() - 1);
        let batch = BatchToken::run(0, start as Pos, &tokens[start..end]);
        let log_probs = log_softmax(&forward(&batch)?)?;
        let next = Tensor::from_vec(
            tokens[start + 1..end + 1].to_vec(),
            (end - start, 1),
            log_probs.device(),
        )?;
        let picked = log_probs.gather(&next, 1)?.sum_all()?.to_scalar::<f32>()?;
        nll -= f64::from(picked);
    }
    Ok((nll / (tokens.len() - 1) as f64).exp())
}

/// `log_softmax` over the last axis of `[n, vocab]`, in f32.
fn log_softmax(logits: &Tensor) -> Result<Tensor> {
    let max = logits.max_keepdim(D::Minus1)?;
    let shifted = logits.broadcast_sub(&max)?;
    let sum = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok(shifted.broadcast_sub(&sum)?)
}

/// Greedy continuations of `prompts`, `new_tokens` each, through caches storing
/// `storage` (generation stops early at end of sequence).
pub fn continuations(
    model: &Llama,
    prompts: &[Vec<u32>],
    new_tokens: usize,
    eos: u32,
    storage: KvStorage,
) -> Result<Vec<Vec<u32>>> {
    prompts
        .iter()
        .map(|prompt| {
            let mut cache = cache_for(storage, prompt.len() + new_tokens, prompt.len().max(1))?;
            greedy(model, &mut cache, 0, prompt, new_tokens, Some(eos))
        })
        .collect()
}

/// Tokens of `got` equal to `want`'s before their first difference.
fn agreeing_prefix(got: &[u32], want: &[u32]) -> usize {
    got.iter().zip(want).take_while(|(a, b)| a == b).count()
}

/// Measures every storage type ([`KvStorage::ALL`], f32 first) by `plan` on
/// `model` over the E1 `trace`.
pub fn measure(
    model: &Llama,
    tokenizer: &ChatTokenizer,
    trace: &Trace,
    plan: &AccuracyPlan,
) -> Result<AccuracyReport> {
    let mut text = tokenizer.encode(&reference_text(trace))?;
    text.truncate(plan.text_tokens);
    let prompts: Vec<Vec<u32>> = trace
        .requests
        .iter()
        .filter(|r| r.turn == 1)
        .take(plan.prompts)
        .map(|r| r.token_ids.clone())
        .collect();
    let eos = tokenizer.eos_token_id();
    let mut rows = Vec::new();
    let mut reference: Option<Vec<Vec<u32>>> = None;
    for storage in KvStorage::ALL {
        let (ppl, bytes) = perplexity(model, &text, storage, plan.pass_len)?;
        let generated = continuations(model, &prompts, plan.new_tokens, eos, storage)?;
        let want = reference.get_or_insert_with(|| generated.clone());
        rows.push(StorageAccuracy {
            storage,
            perplexity: ppl,
            greedy_agree: generated
                .iter()
                .zip(want.iter())
                .map(|(g, w)| agreeing_prefix(g, w))
                .sum(),
            greedy_total: want.iter().map(Vec::len).sum(),
            bytes_per_token: bytes,
        });
    }
    Ok(AccuracyReport {
        plan: plan.clone(),
        rows,
    })
}
