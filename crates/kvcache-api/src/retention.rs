//! Block retention seen from the driver: the chain a finished sequence is kept
//! as, and the longest indexed prefix of a new prompt, for any cache that
//! [indexes blocks](crate::CausalCache::indexes_blocks).
//!
//! A sequence is kept as its full blocks of `block_tokens` tokens, then its
//! *tail* (the last, shorter block), each keyed by [`BlockKey`] over every
//! token from position 0 ([`crate::block_key`]), so a prefix is found again
//! whatever sequence id computed it, and never across scopes (model and
//! namespace enter every key). A tail is always a leaf: a sequence that adopts
//! one and goes on is kept as its own full blocks.

use crate::block_key::{BlockKey, KeyChain, Scope};
use crate::CausalCache;

/// The chain `tokens` is retained as: `(key, len)` per full block of
/// `block_tokens`, then the tail if any.
///
/// ```
/// use kvcache_api::block_key::Scope;
/// use kvcache_api::retention::block_chain;
/// use kvcache_api::{Fingerprint, Namespace};
///
/// let (fp, ns) = (Fingerprint([1; 32]), Namespace::shared());
/// let tokens: Vec<u32> = (0..10).collect();
/// let chain = block_chain(Scope::new(&fp, &ns), 4, &tokens);
/// let lens: Vec<usize> = chain.iter().map(|b| b.1).collect();
/// assert_eq!(lens, [4, 4, 2]);
/// ```
pub fn block_chain(scope: Scope<'_>, block_tokens: usize, tokens: &[u32]) -> Vec<(BlockKey, usize)> {
    let mut chain = KeyChain::new(scope, block_tokens, tokens);
    let mut out: Vec<(BlockKey, usize)> = chain.by_ref().map(|(range, key)| (key, range.len())).collect();
    let tail = chain.remaining();
    if tail > 0 {
        out.push((chain.tail_key(tail).expect("the tail is there"), tail));
    }
    out
}

/// The longest chain of blocks `cache` indexes that starts `tokens` in
/// `scope` and ends at most at `limit` tokens: the keys to
/// [`adopt_blocks`](CausalCache::adopt_blocks) and the tokens they cover.
/// Asks the cache which block lengths follow each block and hashes only those.
pub fn indexed_prefix<C: CausalCache + ?Sized>(
    cache: &C,
    scope: Scope<'_>,
    tokens: &[u32],
    limit: usize,
) -> (Vec<BlockKey>, usize) {
    let limit = limit.min(tokens.len());
    let (mut keys, mut pos, mut parent) = (Vec::new(), 0, BlockKey::ROOT);
    'walk: loop {
        for len in cache.block_lengths(&parent) {
            if pos + len > limit {
                continue;
            }
            let key = BlockKey::new(&scope, &parent, &tokens[pos..pos + len]);
            if cache.holds_block(&key) {
                keys.push(key);
                pos += len;
                parent = key;
                continue 'walk;
            }
        }
        return (keys, pos);
    }
}
