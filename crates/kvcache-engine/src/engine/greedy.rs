//! Greedy generation of one sequence through a [`CausalCache`], without the
//! engine: the reference the engine's answers are checked against.

use candle_core::Tensor;
use kvcache_api::{CausalCache, Pos, SeqId};
use kvcache_models::{argmax, BatchToken, Model};

use crate::{EngineError, Result};

/// Prefills `prompt` into sequence `seq` (from position 0) and decodes up to
/// `max_new` tokens greedily, stopping after `eos` if given. Returns the new tokens.
/// The sequence is left in the cache.
pub fn greedy<M, C>(
    model: &M,
    cache: &mut C,
    seq: SeqId,
    prompt: &[u32],
    max_new: usize,
    eos: Option<u32>,
) -> Result<Vec<u32>>
where
    M: Model,
    C: CausalCache<Tensor = Tensor> + ?Sized,
{
    if prompt.is_empty() {
        return Err(EngineError::InvalidArgument("empty prompt".into()));
    }
    let batch = BatchToken::run(seq, 0, prompt);
    let mut out = Vec::new();
    let mut next = last_token(model, &batch, cache)?;
    let mut pos = prompt.len() as Pos;
    while out.len() < max_new {
        out.push(next);
        if Some(next) == eos || out.len() == max_new {
            break;
        }
        next = last_token(
            model,
            &[BatchToken {
                seq,
                pos,
                token: next,
            }],
            cache,
        )?;
        pos += 1;
    }
    Ok(out)
}

/// Runs `batch` and returns the greedy choice after its last token.
fn last_token<M, C>(model: &M, batch: &[BatchToken], cache: &mut C) -> Result<u32>
where
    M: Model,
    C: CausalCache<Tensor = Tensor> + ?Sized,
{
    let hidden = model.hidden(batch, cache)?;
    let last = hidden.narrow(0, batch.len() - 1, 1)?;
    let row = model.logits(&last)?.squeeze(0)?.to_vec1::<f32>()?;
    Ok(argmax(&row))
}
