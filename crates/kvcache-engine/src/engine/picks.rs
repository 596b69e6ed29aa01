//! The logits of a pass's pick rows, brought to the host as sampling needs
//! them.
//!
//! On the CPU the logits are host memory already and every row is read whole.
//! On a GPU a row is the vocabulary's size (49,152 f32 for SmolLM2, 262,144
//! for Gemma 3) while a greedy pick needs one token id of it: the argmax runs
//! where the logits are and only the ids cross the bus; the rows a sampler or
//! a request's `min_tokens` reads whole come back whole.

use candle_core::{Tensor, D};

/// What the sampling of one pick row gets.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Pick {
    /// The row's logits, `[vocab]`.
    Row(Vec<f32>),
    /// The greedy pick, made where the logits live.
    Token(u32),
}

/// The picks of `logits` (`[rows, vocab]`, f32): row `i` read whole when
/// `whole[i]`, else its argmax, computed on the logits' device unless that is
/// the CPU (where reading rows costs no transfer).
pub(super) fn fetch(logits: &Tensor, whole: &[bool]) -> candle_core::Result<Vec<Pick>> {
    if logits.device().is_cpu() {
        return Ok(logits.to_vec2::<f32>()?.into_iter().map(Pick::Row).collect());
    }
    fetch_on_device(logits, whole)
}

/// [`fetch`]'s device path (on any device: the tests run it on the CPU).
fn fetch_on_device(logits: &Tensor, whole: &[bool]) -> candle_core::Result<Vec<Pick>> {
    assert_eq!(logits.dim(0)?, whole.len(), "one flag per row of logits");
    let tokens = logits.argmax(D::Minus1)?.to_vec1::<u32>()?;
    let read: Vec<u32> = (0..whole.len() as u32).filter(|&i| whole[i as usize]).collect();
    let mut rows = if read.is_empty() {
        Vec::new()
    } else {
        let idx = Tensor::from_vec(read.clone(), read.len(), logits.device())?;
        logits.index_select(&idx, 0)?.to_vec2::<f32>()?
    }
    .into_iter();
    Ok(whole
        .iter()
        .zip(tokens)
        .map(|(&whole, token)| match whole {
            true => Pick::Row(rows.next().expect("one row read per flag")),
            false => Pick::Token(token),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use kvcache_models::argmax;

    fn logits() -> (Vec<Vec<f32>>, Tensor) {
        let rows: Vec<Vec<f32>> = (0..4u32)
            .map(|r| {
                (0..37u32)
                    .map(|c| ((r * 7 + c * 13) % 29) as f32 - 0.5 * c as f32)
                    .collect()
            })
            .collect();
        let t = Tensor::new(rows.clone(), &Device::Cpu).unwrap();
        (rows, t)
    }

    #[test]
    fn the_cpu_reads_every_row() {
        let (rows, t) = logits();
        let picks = fetch(&t, &[false, true, false, false]).unwrap();
        assert_eq!(picks, rows.into_iter().map(Pick::Row).collect::<Vec<_>>());
    }

    #[test]
    fn the_device_path_brings_ids_and_the_rows_asked_for() {
        let (rows, t) = logits();
        let whole = [false, true, false, true];
        let picks = fetch_on_device(&t, &whole).unwrap();
        let expected: Vec<Pick> = rows
            .iter()
            .zip(whole)
            .map(|(row, whole)| match whole {
                true => Pick::Row(row.clone()),
                false => Pick::Token(argmax(row)),
            })
            .collect();
        assert_eq!(picks, expected);
        assert!(matches!(picks[0], Pick::Token(t) if t != 0));
        assert_eq!(fetch_on_device(&t, &[false; 4]).unwrap().len(), 4);
    }
}
