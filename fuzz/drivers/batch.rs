//! Batch construction from arbitrary input.
//!
//! The bytes become position and sequence lists (unequal lengths, empty,
//! negative, repeated and extreme values included) given to `Batch::new`,
//! `Batch::from_tokens` and `Batch::sequence`. Each call must agree with a plain
//! re-statement of the rules (non-empty, equal lengths, no negative position, no
//! repeated `(sequence, position)`, `sequence` ranges that fit in `i32`), fail
//! only with `InvalidBatch`, and an accepted batch must hand back exactly what it
//! was given through every accessor.
#![allow(dead_code)]

use std::collections::HashSet;

use kvcache_api::{Batch, CacheError, Pos, SeqId};

use super::input::Input;

/// One construction call.
#[derive(Debug, Clone)]
pub enum Call {
    /// `Batch::new(positions, sequences)`.
    New(Vec<Pos>, Vec<SeqId>),
    /// `Batch::from_tokens(tokens)`.
    FromTokens(Vec<(SeqId, Pos)>),
    /// `Batch::sequence(seq, start, len)`.
    Sequence(SeqId, Pos, usize),
}

fn pos(input: &mut Input) -> Pos {
    match input.below(8) {
        0 => input.u32() as Pos,
        1 => input.pick(&[Pos::MIN, -1, 0, Pos::MAX - 1, Pos::MAX]),
        _ => Pos::from(input.u8() % 16),
    }
}

fn seq(input: &mut Input) -> SeqId {
    match input.below(8) {
        0 => input.pick(&[usize::MAX, 1 << 40, 64, 65]),
        _ => input.below(4),
    }
}

/// Decodes construction calls from fuzz bytes.
pub fn decode(bytes: &[u8]) -> Vec<Call> {
    let mut input = Input::new(bytes);
    let mut calls = Vec::new();
    while !input.is_empty() && calls.len() < 64 {
        let n = input.below(12);
        calls.push(match input.below(3) {
            0 => {
                let m = if input.chance(15) { input.below(12) } else { n };
                Call::New(
                    (0..n).map(|_| pos(&mut input)).collect(),
                    (0..m).map(|_| seq(&mut input)).collect(),
                )
            }
            1 => Call::FromTokens((0..n).map(|_| (seq(&mut input), pos(&mut input))).collect()),
            // Lengths stay small: a valid batch of two billion tokens is allowed to
            // allocate two billion tokens.
            _ => Call::Sequence(seq(&mut input), pos(&mut input), input.below(40)),
        });
    }
    calls
}

/// The rules of a valid batch, stated plainly.
fn valid(positions: &[Pos], sequences: &[SeqId]) -> bool {
    let mut seen = HashSet::new();
    positions.len() == sequences.len()
        && !positions.is_empty()
        && positions.iter().all(|&p| p >= 0)
        && sequences.iter().zip(positions).all(|t| seen.insert(t))
}

/// Runs one call and checks its outcome.
pub fn check(call: &Call) -> bool {
    let (result, positions, sequences) = match call {
        Call::New(p, s) => (Batch::new(p.clone(), s.clone()), p.clone(), s.clone()),
        Call::FromTokens(t) => (
            Batch::from_tokens(t.iter().copied()),
            t.iter().map(|t| t.1).collect(),
            t.iter().map(|t| t.0).collect(),
        ),
        Call::Sequence(seq, start, len) => {
            let end = i64::from(*start) + *len as i64;
            if end > i64::from(Pos::MAX) {
                let r = Batch::sequence(*seq, *start, *len);
                assert!(
                    matches!(r, Err(CacheError::InvalidBatch(_))),
                    "{call:?} gave {r:?}"
                );
                return false;
            }
            let p: Vec<Pos> = (*start..end as Pos).collect();
            (Batch::sequence(*seq, *start, *len), p, vec![*seq; *len])
        }
    };
    let want = valid(&positions, &sequences);
    match result {
        Ok(batch) => {
            assert!(want, "{call:?} was accepted");
            assert_eq!(batch.len(), positions.len());
            assert!(!batch.is_empty());
            assert_eq!(batch.positions(), &positions[..]);
            assert_eq!(batch.sequences(), &sequences[..]);
            let tokens: Vec<(SeqId, Pos)> = batch.tokens().collect();
            assert_eq!(tokens.len(), batch.len());
            for (i, &t) in tokens.iter().enumerate() {
                assert_eq!(t, (sequences[i], positions[i]));
                assert_eq!(batch.token(i), t);
            }
            assert_eq!(batch.clone(), batch);
            true
        }
        Err(e) => {
            assert!(!want, "{call:?} was rejected: {e}");
            assert!(matches!(e, CacheError::InvalidBatch(_)), "{call:?}: {e:?}");
            assert!(!e.to_string().is_empty());
            false
        }
    }
}

/// Accepted and rejected calls.
#[derive(Debug, Default, Clone, Copy)]
pub struct Tally {
    /// Batches built.
    pub accepted: usize,
    /// Calls rejected.
    pub rejected: usize,
}

/// Runs decoded calls, panicking on any violation.
pub fn run(_: &(), calls: &[Call]) -> Tally {
    let mut tally = Tally::default();
    for call in calls {
        if check(call) {
            tally.accepted += 1;
        } else {
            tally.rejected += 1;
        }
    }
    tally
}

/// Decodes and runs fuzz bytes (the cargo-fuzz entry point).
pub fn fuzz(bytes: &[u8]) -> Tally {
    run(&(), &decode(bytes))
}
