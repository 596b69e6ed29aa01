//! Token positions, sequence ids and the batch of one forward pass.

use crate::{CacheError, Result};

/// A token's position inside its sequence; positions start at 0.
///
/// Signed because engines compute position deltas (shifts) in the same type.
pub type Pos = i32;

/// Identifies one stream of tokens (one user, one branch). Valid ids are
/// `0..max_sequences` of the cache they are used with.
pub type SeqId = usize;

/// The tokens of one forward pass: for token `i`, `positions()[i]` within
/// sequence `sequences()[i]`.
///
/// A batch is validated once at construction: it is not empty, both lists have the
/// same length, no position is negative, and no `(sequence, position)` pair appears
/// twice. Sequence ids are checked against a cache's range when the batch is used.
///
/// ```
/// use kvcache_api::Batch;
///
/// // Sequence 0 prefills positions 0..4 while sequence 1 decodes position 7.
/// let batch = Batch::new(vec![0, 1, 2, 3, 7], vec![0, 0, 0, 0, 1])?;
/// assert_eq!(batch.len(), 5);
/// assert_eq!(batch.token(4), (1, 7));
///
/// assert!(Batch::new(vec![0, 1], vec![0]).is_err()); // lengths differ
/// # Ok::<(), kvcache_api::CacheError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    positions: Vec<Pos>,
    sequences: Vec<SeqId>,
}

impl Batch {
    /// Builds a batch from parallel lists of positions and sequence ids.
    pub fn new(positions: Vec<Pos>, sequences: Vec<SeqId>) -> Result<Self> {
        if positions.len() != sequences.len() {
            return Err(CacheError::InvalidBatch(format!(
                "{} positions but {} sequence ids",
                positions.len(),
                sequences.len()
            )));
        }
        if positions.is_empty() {
            return Err(CacheError::InvalidBatch("the batch is empty".into()));
        }
        if let Some(i) = positions.iter().position(|&p| p < 0) {
            return Err(CacheError::InvalidBatch(format!(
                "token {i} has negative position {}",
                positions[i]
            )));
        }
        let mut pairs: Vec<(SeqId, Pos)> = sequences.iter().copied().zip(positions.iter().copied()).collect();
        pairs.sort_unstable();
        if let Some(w) = pairs.windows(2).find(|w| w[0] == w[1]) {
            return Err(CacheError::InvalidBatch(format!(
                "sequence {} has position {} twice",
                w[0].0, w[0].1
            )));
        }
        Ok(Batch { positions, sequences })
    }

    /// Consecutive positions `start..start + len` of one sequence: a prefill
    /// chunk, or a single decode step with `len == 1`.
    pub fn sequence(seq: SeqId, start: Pos, len: usize) -> Result<Self> {
        let end = Pos::try_from(len)
            .ok()
            .and_then(|l| start.checked_add(l))
            .ok_or_else(|| CacheError::InvalidBatch(format!("{len} tokens from {start} overflow i32")))?;
        Batch::new((start..end).collect(), vec![seq; len])
    }

    /// Builds a batch from `(sequence, position)` pairs in batch order.
    pub fn from_tokens(tokens: impl IntoIterator<Item = (SeqId, Pos)>) -> Result<Self> {
        let (sequences, positions) = tokens.into_iter().unzip();
        Batch::new(positions, sequences)
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    /// Always false: an empty batch is rejected at construction.
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// Position of each token, in batch order.
    pub fn positions(&self) -> &[Pos] {
        &self.positions
    }

    /// Sequence of each token, in batch order.
    pub fn sequences(&self) -> &[SeqId] {
        &self.sequences
    }

    /// `(sequence, position)` of token `i`. Panics if `i >= len()`.
    pub fn token(&self, i: usize) -> (SeqId, Pos) {
        (self.sequences[i], self.positions[i])
    }

    /// `(sequence, position)` of every token, in batch order.
    pub fn tokens(&self) -> impl ExactSizeIterator<Item = (SeqId, Pos)> + '_ {
        self.sequences.iter().copied().zip(self.positions.iter().copied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_malformed_batches() {
        assert!(matches!(
            Batch::new(vec![], vec![]),
            Err(CacheError::InvalidBatch(_))
        ));
        assert!(
            matches!(Batch::new(vec![0, -1], vec![0, 0]), Err(CacheError::InvalidBatch(m)) if m.contains("negative"))
        );
        assert!(
            matches!(Batch::new(vec![3, 3], vec![1, 1]), Err(CacheError::InvalidBatch(m)) if m.contains("twice"))
        );
        assert!(Batch::new(vec![3, 3], vec![0, 1]).is_ok());
        assert!(Batch::sequence(0, i32::MAX, 2).is_err());
    }

    #[test]
    fn constructors_agree() {
        let a = Batch::sequence(2, 5, 3).unwrap();
        let b = Batch::from_tokens([(2, 5), (2, 6), (2, 7)]).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.positions(), &[5, 6, 7]);
        assert_eq!(a.tokens().collect::<Vec<_>>(), vec![(2, 5), (2, 6), (2, 7)]);
    }
}
