//! Block retention, the words a driver and a cache that
//! [indexes blocks](crate::CausalCache::indexes_blocks) share: the chain a
//! finished sequence is kept as, the longest kept prefix of a new prompt, and
//! the journal of what the index stored and removed.
//!
//! A sequence is kept as its full blocks of `block_tokens` tokens, then its
//! *tail* (the last, shorter block), each keyed by [`BlockKey`] over every
//! token from position 0 ([`crate::block_key`]), so a prefix is found again
//! whatever sequence id computed it, and never across scopes (model and
//! namespace enter every key). A tail is always a leaf: a sequence that adopts
//! one and goes on is kept as its own full blocks. The cache's index keeps
//! each block's tokens, so a prompt that parts from a kept one inside a block
//! still reuses every token before the parting, and no key can name tokens
//! other than its own.

use crate::block_key::{BlockKey, KeyChain, Scope};
use crate::{Fingerprint, Namespace};

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

/// A sequence's tokens as the chain of blocks it is retained as
/// ([`CausalCache::retain_blocks`](crate::CausalCache::retain_blocks)): the
/// scope its keys are hashed in, the keys with their lengths, and the tokens
/// they cover from position 0.
///
/// ```
/// use kvcache_api::retention::BlockChain;
/// use kvcache_api::{Fingerprint, Namespace};
///
/// let chain = BlockChain::new(Fingerprint([1; 32]), Namespace::shared(), 4, &[5; 10]);
/// assert_eq!(chain.blocks().len(), 3);
/// assert_eq!(chain.block_tokens(2), &[5, 5]);
/// assert!(chain.keys_match());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockChain {
    fingerprint: Fingerprint,
    namespace: Namespace,
    blocks: Vec<(BlockKey, usize)>,
    /// Where each block's tokens start in `tokens`.
    starts: Vec<usize>,
    tokens: Vec<u32>,
}

impl BlockChain {
    /// The chain `tokens` is kept as in blocks of `block_tokens` under the
    /// model `fingerprint` and `namespace` ([`block_chain`]).
    pub fn new(fingerprint: Fingerprint, namespace: Namespace, block_tokens: usize, tokens: &[u32]) -> Self {
        let blocks = block_chain(Scope::new(&fingerprint, &namespace), block_tokens, tokens);
        Self::from_parts(fingerprint, namespace, blocks, tokens.to_vec())
    }

    /// A chain from its parts as given, for a caller that computed the keys
    /// itself (a test building a wrong one): `blocks[i] = (key, len)` covers
    /// the `len` tokens after those of `blocks[..i]`. The lengths may add up
    /// to more tokens than `tokens` has; [`keys_match`](Self::keys_match)
    /// then fails.
    pub fn from_parts(
        fingerprint: Fingerprint,
        namespace: Namespace,
        blocks: Vec<(BlockKey, usize)>,
        tokens: Vec<u32>,
    ) -> Self {
        let starts = blocks
            .iter()
            .scan(0, |start, &(_, len)| {
                let here = *start;
                *start += len;
                Some(here)
            })
            .collect();
        BlockChain {
            fingerprint,
            namespace,
            blocks,
            starts,
            tokens,
        }
    }

    /// The model the keys belong to.
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    /// The namespace the keys belong to.
    pub fn namespace(&self) -> &Namespace {
        &self.namespace
    }

    /// The scope every key is hashed in.
    pub fn scope(&self) -> Scope<'_> {
        Scope::new(&self.fingerprint, &self.namespace)
    }

    /// `(key, len)` per block, from position 0.
    pub fn blocks(&self) -> &[(BlockKey, usize)] {
        &self.blocks
    }

    /// The tokens the chain covers.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The tokens of block `i` (fewer than its length, or none, when the
    /// chain claims more tokens than it has).
    pub fn block_tokens(&self, i: usize) -> &[u32] {
        let start = self.starts[i].min(self.tokens.len());
        let end = (self.starts[i] + self.blocks[i].1).min(self.tokens.len());
        &self.tokens[start..end]
    }

    /// Whether every block has its tokens, none is empty, and each key is
    /// the one its scope, parent and tokens hash to.
    pub fn keys_match(&self) -> bool {
        let scope = self.scope();
        let mut parent = BlockKey::ROOT;
        for (i, &(key, len)) in self.blocks.iter().enumerate() {
            let tokens = self.block_tokens(i);
            if len == 0 || tokens.len() != len || BlockKey::new(&scope, &parent, tokens) != key {
                return false;
            }
            parent = key;
        }
        true
    }
}

/// The longest prefix a lookup found
/// ([`CausalCache::longest_prefix`](crate::CausalCache::longest_prefix)): the
/// chain to [`adopt_blocks`](crate::CausalCache::adopt_blocks) and how many
/// of its positions match (its last block possibly in part).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prefix {
    /// The chain, from the prompt's first block.
    pub keys: Vec<BlockKey>,
    /// Tokens matched.
    pub len: usize,
}

/// One change to a block index, in the order it happened, for whoever
/// reports the index to a router ([`crate::events::EventBatch::block_changes`])
/// or mirrors it. Replaying a cache's changes from its creation gives exactly
/// its index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockChange {
    /// Block `key` was indexed after `parent` ([`BlockKey::ROOT`] for a first
    /// block) holding `tokens`.
    Stored {
        /// The block.
        key: BlockKey,
        /// The block it follows.
        parent: BlockKey,
        /// Its tokens.
        tokens: Vec<u32>,
        /// The namespace its key was hashed in.
        namespace: Namespace,
    },
    /// Block `key` of `len` tokens left the index (evicted, aged out,
    /// forgotten, cleared, or moved by a shifting removal). A block leaves
    /// only after every block below it.
    Removed {
        /// The block.
        key: BlockKey,
        /// Its length in tokens.
        len: usize,
    },
}
