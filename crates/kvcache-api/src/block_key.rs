//! Block keys, vLLM's prefix-caching design (shared by the prefix store and the
//! causal cache's block index): a prompt is cut into blocks of
//! `block_tokens` tokens, and the key of block `k` is a SHA-256 over
//!
//! 1. the domain tag [`DOMAIN`],
//! 2. the [`Scope`] (model fingerprint, tagged and length-prefixed namespace),
//! 3. the key of block `k - 1`, or [`BlockKey::ROOT`] (zeros) for the first block,
//! 4. the block's token count (u32 LE) and its tokens (u32 LE each).
//!
//! A key therefore names a whole prefix, not one block: equal keys mean equal
//! tokens from offset 0 on. The last block of a stored run may be shorter (a
//! *tail*); it is keyed the same way over its shorter token list, so its key never
//! equals that of a full block unless the tokens are the same.
//!
//! Computing keys needs only the tokens: [`KeyChain`] walks them without I/O.
//!
//! The [`Scope`] enters every key: the model's fingerprint, then the namespace
//! preceded by a tag (shared or salted) and its length, so `""` and any salt, or
//! two salts, never hash the same input.

use std::ops::Range;

use sha2::Digest;
pub use sha2::Sha256;

use crate::host::{Fingerprint, Namespace};

/// The partition a block lives in: which model produced it and which tenant
/// may read it back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scope<'a> {
    /// The model's fingerprint.
    pub fingerprint: &'a Fingerprint,
    /// The tenant's namespace.
    pub namespace: &'a Namespace,
}

/// Tag of the shared namespace in key hashes.
const SHARED: u8 = 0;
/// Tag of a salted namespace in key hashes.
const SALTED: u8 = 1;

impl<'a> Scope<'a> {
    /// The scope of `namespace` under the model `fingerprint`.
    pub fn new(fingerprint: &'a Fingerprint, namespace: &'a Namespace) -> Self {
        Scope {
            fingerprint,
            namespace,
        }
    }

    /// Feeds the fingerprint and the tagged, length-prefixed namespace to
    /// `hasher` (the bytes every key of this scope starts from).
    pub fn hash_into(&self, hasher: &mut Sha256) {
        hasher.update(self.fingerprint.0);
        let ns = self.namespace.as_str().as_bytes();
        hasher.update([if self.namespace.is_shared() {
            SHARED
        } else {
            SALTED
        }]);
        hasher.update((ns.len() as u32).to_le_bytes());
        hasher.update(ns);
    }
}

/// The domain tag that opens every key hash (bump it when the encoding changes; the
/// name predates the move out of the store and stays, so stored keys stay valid).
pub const DOMAIN: &[u8] = b"kvcache-store/block/v1";

/// The key of one stored block: a digest of its scope and of every token from
/// offset 0 to the block's end.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct BlockKey(pub [u8; 32]);

impl BlockKey {
    /// The parent of a prompt's first block (zeros).
    pub const ROOT: BlockKey = BlockKey([0; 32]);

    /// The key of a block of `tokens` following `parent` in `scope`.
    pub fn new(scope: &Scope<'_>, parent: &BlockKey, tokens: &[u32]) -> BlockKey {
        let mut hasher = Sha256::new();
        hasher.update(DOMAIN);
        scope.hash_into(&mut hasher);
        hasher.update(parent.0);
        hasher.update((tokens.len() as u32).to_le_bytes());
        for token in tokens {
            hasher.update(token.to_le_bytes());
        }
        BlockKey(hasher.finalize().into())
    }

    /// Whether this is [`BlockKey::ROOT`].
    pub fn is_root(&self) -> bool {
        *self == Self::ROOT
    }

    /// Lower-case hex, 64 digits.
    pub fn to_hex(&self) -> String {
        crate::host::hex(&self.0)
    }

    /// Parses 64 hex digits; `None` for anything else.
    pub fn from_hex(text: &str) -> Option<BlockKey> {
        let bytes = text.as_bytes();
        if bytes.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, pair) in bytes.chunks(2).enumerate() {
            let hi = (pair[0] as char).to_digit(16)?;
            let lo = (pair[1] as char).to_digit(16)?;
            out[i] = (hi * 16 + lo) as u8;
        }
        Some(BlockKey(out))
    }
}

impl std::fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BlockKey({})", &self.to_hex()[..16])
    }
}

impl std::fmt::Display for BlockKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// The chain of full-block keys over a token list, computed lazily.
///
/// ```
/// use kvcache_api::block_key::{BlockKey, KeyChain, Scope};
/// use kvcache_api::{Fingerprint, Namespace};
///
/// let (fp, ns) = (Fingerprint([7; 32]), Namespace::shared());
/// let scope = Scope::new(&fp, &ns);
/// let tokens: Vec<u32> = (0..10).collect();
/// let keys: Vec<_> = KeyChain::new(scope, 4, &tokens).collect();
/// assert_eq!(keys.len(), 2); // two full blocks; tokens 8..10 are a tail
/// assert_eq!(keys[0].0, 0..4);
/// assert_eq!(keys[1].1, BlockKey::new(&scope, &keys[0].1, &tokens[4..8]));
/// ```
#[derive(Debug, Clone)]
pub struct KeyChain<'a> {
    scope: Scope<'a>,
    block_tokens: usize,
    tokens: &'a [u32],
    parent: BlockKey,
    pos: usize,
}

impl<'a> KeyChain<'a> {
    /// The chain of `tokens` cut into blocks of `block_tokens` (at least 1).
    pub fn new(scope: Scope<'a>, block_tokens: usize, tokens: &'a [u32]) -> Self {
        KeyChain {
            scope,
            block_tokens: block_tokens.max(1),
            tokens,
            parent: BlockKey::ROOT,
            pos: 0,
        }
    }

    /// The key of the last block yielded ([`BlockKey::ROOT`] before the first).
    pub fn parent(&self) -> BlockKey {
        self.parent
    }

    /// The offset where the next block starts.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Skips (hashing only) to the block that contains offset `at`, or to the
    /// last block boundary at or before the end of the full blocks.
    pub fn skip_to(&mut self, at: usize) {
        let target = at / self.block_tokens * self.block_tokens;
        while self.pos < target && self.next().is_some() {}
    }

    /// The key of the tail `tokens[position..position + len]` after the current
    /// parent, or `None` when the tokens end sooner.
    pub fn tail_key(&self, len: usize) -> Option<BlockKey> {
        let tokens = self.tokens.get(self.pos..self.pos + len)?;
        Some(BlockKey::new(&self.scope, &self.parent, tokens))
    }

    /// Tokens left after the current position.
    pub fn remaining(&self) -> usize {
        self.tokens.len() - self.pos
    }
}

impl KeyChain<'_> {
    /// The next full block's token range and key, without moving past it.
    pub fn peek(&self) -> Option<(Range<usize>, BlockKey)> {
        let range = self.pos..self.pos + self.block_tokens;
        let tokens = self.tokens.get(range.clone())?;
        Some((range, BlockKey::new(&self.scope, &self.parent, tokens)))
    }
}

impl Iterator for KeyChain<'_> {
    type Item = (Range<usize>, BlockKey);

    /// The next full block's token range and key.
    fn next(&mut self) -> Option<Self::Item> {
        let (range, key) = self.peek()?;
        self.parent = key;
        self.pos = range.end;
        Some((range, key))
    }
}
