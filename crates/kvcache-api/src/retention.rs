//! Block retention seen from the driver: the chain a finished sequence is kept
//! as, and the longest indexed prefix of a new prompt, for any cache that
//! [indexes blocks](crate::CausalCache::indexes_blocks).
//!
//! A sequence is kept as its full blocks of `block_tokens` tokens, then its
//! *tail* (the last, shorter block), each keyed by [`BlockKey`] over every
//! token from position 0 ([`crate::block_key`]), so a prefix is found again
//! whatever sequence id computed it, and never across scopes (model and
//! namespace enter every key). A tail is always a leaf: a sequence that adopts
//! one and goes on is kept as its own full blocks. The driver keeps each
//! kept block's tokens ([`BlockTokens`]), so a prompt that parts from a kept
//! one inside a block still reuses every token before the parting.

use std::collections::HashMap;
use std::time::{Duration, Instant};

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

/// The longest prefix a lookup found: the chain to
/// [`adopt_blocks`](CausalCache::adopt_blocks) and how many of its positions
/// match (its last block possibly in part).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prefix {
    /// The chain, from the prompt's first block.
    pub keys: Vec<BlockKey>,
    /// Tokens matched.
    pub len: usize,
}

/// The tokens of each block a cache indexes and when it was last used, kept
/// by whoever drives the cache: the cache knows positions and keys, the
/// driver knows tokens. Lets a lookup match a block in part (a prompt that
/// parts from a kept one mid-block reuses every token up to the parting),
/// and ages blocks by time.
#[derive(Debug, Clone, Default)]
pub struct BlockTokens {
    blocks: HashMap<BlockKey, (Vec<u32>, Instant)>,
}

impl BlockTokens {
    /// Blocks recorded.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The tokens of block `key`, if recorded.
    pub fn tokens(&self, key: &BlockKey) -> Option<&[u32]> {
        self.blocks.get(key).map(|(tokens, _)| tokens.as_slice())
    }

    /// Records the blocks `new` (indices into `chain`, which covers `tokens`
    /// from position 0) and marks the whole chain used now.
    pub fn record(&mut self, chain: &[(BlockKey, usize)], tokens: &[u32], new: &[usize]) {
        let now = Instant::now();
        let mut start = 0;
        for (i, &(key, len)) in chain.iter().enumerate() {
            if new.contains(&i) {
                self.blocks
                    .insert(key, (tokens[start..start + len].to_vec(), now));
            } else if let Some(entry) = self.blocks.get_mut(&key) {
                entry.1 = now;
            }
            start += len;
        }
    }

    /// Marks `keys` used now.
    pub fn touch(&mut self, keys: &[BlockKey]) {
        let now = Instant::now();
        for key in keys {
            if let Some(entry) = self.blocks.get_mut(key) {
                entry.1 = now;
            }
        }
    }

    /// Forgets `keys` (evicted or forgotten by the cache).
    pub fn forget(&mut self, keys: &[BlockKey]) {
        for key in keys {
            self.blocks.remove(key);
        }
    }

    /// The blocks not used for `age`. A parent is used whenever its
    /// children are, so the set holds every block below each of its blocks.
    pub fn unused_for(&self, age: Duration) -> Vec<BlockKey> {
        self.blocks
            .iter()
            .filter(|(_, (_, used))| used.elapsed() >= age)
            .map(|(key, _)| *key)
            .collect()
    }

    /// The longest prefix of `tokens`, at most `limit` of them, that `cache`
    /// holds in blocks of `scope`: down the chain of blocks whose tokens the
    /// prompt repeats, then as far into one more block as the prompt follows
    /// it. A block counts only when its key is the one `scope` gives its
    /// tokens, so no lookup crosses models or namespaces.
    pub fn longest_prefix<C: CausalCache + ?Sized>(
        &self,
        cache: &C,
        scope: Scope<'_>,
        tokens: &[u32],
        limit: usize,
    ) -> Prefix {
        let limit = limit.min(tokens.len());
        let mut found = Prefix::default();
        let mut parent = BlockKey::ROOT;
        while found.len < limit {
            let rest = &tokens[found.len..limit];
            let mut candidates: Vec<(usize, BlockKey, &[u32])> = cache
                .block_children(&parent)
                .into_iter()
                .filter_map(|(key, _)| {
                    let held = &self.blocks.get(&key)?.0;
                    let matched = held.iter().zip(rest).take_while(|(a, b)| a == b).count();
                    (matched > 0).then_some((matched, key, held.as_slice()))
                })
                .collect();
            candidates.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            let Some(&(matched, key, held)) = candidates
                .iter()
                .find(|(_, key, held)| BlockKey::new(&scope, &parent, held) == *key)
            else {
                break;
            };
            found.keys.push(key);
            found.len += matched;
            if matched < held.len() {
                break;
            }
            parent = key;
        }
        found
    }
}
