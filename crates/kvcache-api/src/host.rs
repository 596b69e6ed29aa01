//! Keys and values on the host: the form in which KV state leaves a cache (to a
//! store, a file, another process) and comes back.
//!
//! [`HostKv`] holds a run of consecutive token offsets `[start, start + tokens)`
//! for every layer of a model, in one buffer. The form is canonical, whatever
//! the backend stores: per layer, keys `[kv_heads, tokens, head_dim]` then values
//! `[kv_heads, tokens, head_dim_v]`, row-major, little-endian elements of the
//! layout's dtype. Any cache with the same [`KvLayout`] can read it, whichever
//! value layout it uses internally.

use std::ops::Range;

use crate::{CacheError, DType, Pos, Result};

/// The shape of one model's keys and values, which a [`HostKv`] must match to be
/// written into a cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    /// Number of layers.
    pub layers: usize,
    /// Key/value heads per layer.
    pub kv_heads: usize,
    /// Elements per key head.
    pub head_dim: usize,
    /// Elements per value head.
    pub head_dim_v: usize,
    /// Element type.
    pub dtype: DType,
}

impl KvLayout {
    /// A layout whose keys and values have the same head dimension.
    pub fn new(layers: usize, kv_heads: usize, head_dim: usize, dtype: DType) -> Self {
        KvLayout {
            layers,
            kv_heads,
            head_dim,
            head_dim_v: head_dim,
            dtype,
        }
    }

    /// Bytes of one token in one layer (its keys and values).
    pub fn layer_token_bytes(&self) -> usize {
        self.kv_heads * (self.head_dim + self.head_dim_v) * self.dtype.size_in_bytes()
    }

    /// Bytes of one token over every layer.
    pub fn token_bytes(&self) -> usize {
        self.layers * self.layer_token_bytes()
    }

    /// Checks that `other` is this layout, naming the first field that differs.
    pub fn expect(&self, other: &KvLayout) -> Result<()> {
        let fields = [
            ("layers", self.layers, other.layers),
            ("kv_heads", self.kv_heads, other.kv_heads),
            ("head_dim", self.head_dim, other.head_dim),
            ("head_dim_v", self.head_dim_v, other.head_dim_v),
        ];
        for (what, want, got) in fields {
            if want != got {
                return Err(CacheError::LayoutMismatch {
                    what,
                    expected: want.to_string(),
                    got: got.to_string(),
                });
            }
        }
        if self.dtype != other.dtype {
            return Err(CacheError::LayoutMismatch {
                what: "dtype",
                expected: self.dtype.to_string(),
                got: other.dtype.to_string(),
            });
        }
        Ok(())
    }
}

/// Which model produced some keys and values: 32 bytes the engine chooses (a
/// digest of the weights file, say). Stores key everything by it, so state of
/// one model is never restored into another.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// Lower-case hex, 64 characters.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// Parses 64 hex digits.
    pub fn from_hex(text: &str) -> Result<Self> {
        let bytes = text.as_bytes();
        if bytes.len() != 64 {
            return Err(CacheError::InvalidArgument(format!(
                "a fingerprint is 64 hex digits, got {} characters",
                bytes.len()
            )));
        }
        let mut out = [0u8; 32];
        for (i, pair) in bytes.chunks(2).enumerate() {
            let digit = |c: u8| (c as char).to_digit(16);
            match (digit(pair[0]), digit(pair[1])) {
                (Some(hi), Some(lo)) => out[i] = (hi * 16 + lo) as u8,
                _ => {
                    return Err(CacheError::InvalidArgument(format!(
                        "a fingerprint is hex digits, got {text:?}"
                    )))
                }
            }
        }
        Ok(Fingerprint(out))
    }
}

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fingerprint({})", &self.to_hex()[..16])
    }
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 15)] as char);
    }
    out
}

/// A tenant's partition of cached prefixes (OpenAI's and vLLM's `cache_salt`):
/// prefixes are never shared across namespaces.
///
/// Validated where it enters: 1 to [`Namespace::MAX_LEN`] characters from
/// `A-Z a-z 0-9 - _ . : + / =` (enough for UUIDs and base64), so a namespace is
/// always safe inside a file name digest or a Redis key.
///
/// ```
/// use kvcache_api::Namespace;
///
/// let tenant = Namespace::new("tenant-42")?;
/// assert_eq!(tenant.as_str(), "tenant-42");
/// assert!(Namespace::new("a b").is_err());
/// assert!(Namespace::new(&"x".repeat(200)).is_err());
/// assert_eq!(Namespace::shared().as_str(), "");
/// # Ok::<(), kvcache_api::CacheError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Namespace(String);

impl Namespace {
    /// The longest namespace accepted, in bytes.
    pub const MAX_LEN: usize = 128;

    /// The namespace of requests without a salt.
    pub fn shared() -> Self {
        Namespace(String::new())
    }

    /// A validated namespace (see the type's docs); an
    /// [`InvalidNamespace`](CacheError::InvalidNamespace) error says what is wrong.
    pub fn new(salt: &str) -> Result<Self> {
        if salt.is_empty() {
            return Err(CacheError::InvalidNamespace(
                "empty (omit it for the shared namespace)".into(),
            ));
        }
        if salt.len() > Self::MAX_LEN {
            return Err(CacheError::InvalidNamespace(format!(
                "{} bytes long, at most {} allowed",
                salt.len(),
                Self::MAX_LEN
            )));
        }
        if let Some(bad) = salt
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || "-_.:+/=".contains(*c)))
        {
            return Err(CacheError::InvalidNamespace(format!(
                "character {bad:?} not allowed (use A-Z a-z 0-9 - _ . : + / =)"
            )));
        }
        Ok(Namespace(salt.to_owned()))
    }

    /// The namespace of an optional salt: `None` is [`Namespace::shared`].
    pub fn from_salt(salt: Option<&str>) -> Result<Self> {
        salt.map_or(Ok(Self::shared()), Self::new)
    }

    /// The salt, empty for the shared namespace.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether this is the shared namespace.
    pub fn is_shared(&self) -> bool {
        self.0.is_empty()
    }
}

/// Keys and values of token offsets `[start, start + tokens)` for every layer, on
/// the host, in the canonical form of the [module docs](self).
#[derive(Clone, PartialEq, Eq)]
pub struct HostKv {
    layout: KvLayout,
    start: usize,
    tokens: usize,
    data: Vec<u8>,
}

/// One layer of a [`HostKv`]: keys `[kv_heads, tokens, head_dim]` and values
/// `[kv_heads, tokens, head_dim_v]` as bytes.
#[derive(Debug, Clone, Copy)]
pub struct LayerRows<'a> {
    /// The model's layout.
    pub layout: KvLayout,
    /// Tokens held.
    pub tokens: usize,
    /// `[kv_heads, tokens, head_dim]`.
    pub keys: &'a [u8],
    /// `[kv_heads, tokens, head_dim_v]`.
    pub values: &'a [u8],
}

/// One layer of a [`HostKv`], writable.
#[derive(Debug)]
pub struct LayerRowsMut<'a> {
    /// The model's layout.
    pub layout: KvLayout,
    /// Tokens held.
    pub tokens: usize,
    /// `[kv_heads, tokens, head_dim]`.
    pub keys: &'a mut [u8],
    /// `[kv_heads, tokens, head_dim_v]`.
    pub values: &'a mut [u8],
}

impl LayerRows<'_> {
    /// Keys of head `head`, tokens `rows`: `[rows.len(), head_dim]` as bytes.
    pub fn head_keys(&self, head: usize, rows: Range<usize>) -> &[u8] {
        let row = self.layout.head_dim * self.layout.dtype.size_in_bytes();
        let base = head * self.tokens * row;
        &self.keys[base + rows.start * row..base + rows.end * row]
    }

    /// Values of head `head`, tokens `rows`: `[rows.len(), head_dim_v]` as bytes.
    pub fn head_values(&self, head: usize, rows: Range<usize>) -> &[u8] {
        let row = self.layout.head_dim_v * self.layout.dtype.size_in_bytes();
        let base = head * self.tokens * row;
        &self.values[base + rows.start * row..base + rows.end * row]
    }
}

impl LayerRowsMut<'_> {
    /// Keys of head `head`, tokens `rows`, writable.
    pub fn head_keys(&mut self, head: usize, rows: Range<usize>) -> &mut [u8] {
        let row = self.layout.head_dim * self.layout.dtype.size_in_bytes();
        let base = head * self.tokens * row;
        &mut self.keys[base + rows.start * row..base + rows.end * row]
    }

    /// Values of head `head`, tokens `rows`, writable.
    pub fn head_values(&mut self, head: usize, rows: Range<usize>) -> &mut [u8] {
        let row = self.layout.head_dim_v * self.layout.dtype.size_in_bytes();
        let base = head * self.tokens * row;
        &mut self.values[base + rows.start * row..base + rows.end * row]
    }
}

impl HostKv {
    /// Zero-filled keys and values for `[start, start + tokens)`.
    pub fn zeroed(layout: KvLayout, start: usize, tokens: usize) -> Self {
        HostKv {
            layout,
            start,
            tokens,
            data: vec![0; tokens * layout.token_bytes()],
        }
    }

    /// Wraps bytes in the canonical form; their length must be
    /// `tokens * layout.token_bytes()`.
    pub fn from_bytes(layout: KvLayout, start: usize, tokens: usize, data: Vec<u8>) -> Result<Self> {
        let want = tokens * layout.token_bytes();
        if data.len() != want {
            return Err(CacheError::InvalidArgument(format!(
                "{} bytes for {tokens} tokens of a layout taking {want}",
                data.len()
            )));
        }
        Ok(HostKv {
            layout,
            start,
            tokens,
            data,
        })
    }

    /// The model layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The first token offset held.
    pub fn start(&self) -> usize {
        self.start
    }

    /// Tokens held.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// One past the last token offset held.
    pub fn end(&self) -> usize {
        self.start + self.tokens
    }

    /// `start..end`.
    pub fn range(&self) -> Range<usize> {
        self.start..self.end()
    }

    /// Every byte, layer after layer.
    pub fn as_bytes(&self) -> &[u8] {
        &self.data
    }

    /// The bytes, for writing without a copy.
    pub fn into_bytes(self) -> Vec<u8> {
        self.data
    }

    /// Layer `layer`'s keys and values. Panics if `layer` is out of range.
    pub fn layer(&self, layer: usize) -> LayerRows<'_> {
        let (k, v) = self.layer_spans(layer);
        LayerRows {
            layout: self.layout,
            tokens: self.tokens,
            keys: &self.data[k],
            values: &self.data[v],
        }
    }

    /// Layer `layer`'s keys and values, writable. Panics if `layer` is out of range.
    pub fn layer_mut(&mut self, layer: usize) -> LayerRowsMut<'_> {
        let (k, v) = self.layer_spans(layer);
        let (head, tail) = self.data.split_at_mut(v.start);
        LayerRowsMut {
            layout: self.layout,
            tokens: self.tokens,
            keys: &mut head[k],
            values: &mut tail[..v.len()],
        }
    }

    /// A copy of token offsets `range`, which must lie within [`range`](Self::range).
    pub fn slice(&self, range: Range<usize>) -> Result<HostKv> {
        if range.start < self.start || range.end > self.end() || range.start > range.end {
            return Err(CacheError::InvalidArgument(format!(
                "range {range:?} outside the held {:?}",
                self.range()
            )));
        }
        let rows = range.start - self.start..range.end - self.start;
        let mut out = HostKv::zeroed(self.layout, range.start, range.len());
        for layer in 0..self.layout.layers {
            let src = self.layer(layer);
            let mut dst = out.layer_mut(layer);
            for head in 0..self.layout.kv_heads {
                dst.head_keys(head, 0..rows.len())
                    .copy_from_slice(src.head_keys(head, rows.clone()));
                dst.head_values(head, 0..rows.len())
                    .copy_from_slice(src.head_values(head, rows.clone()));
            }
        }
        Ok(out)
    }

    /// Joins consecutive parts of one layout into one. An empty list, parts of
    /// different layouts, or a gap between parts is an error.
    pub fn concat(parts: &[&HostKv]) -> Result<HostKv> {
        let first = parts
            .first()
            .ok_or_else(|| CacheError::InvalidArgument("nothing to join".into()))?;
        let mut end = first.start;
        for part in parts {
            first.layout.expect(&part.layout)?;
            if part.start != end {
                return Err(CacheError::InvalidArgument(format!(
                    "parts are not consecutive: one ends at {end}, the next starts at {}",
                    part.start
                )));
            }
            end = part.end();
        }
        let mut out = HostKv::zeroed(first.layout, first.start, end - first.start);
        for layer in 0..first.layout.layers {
            let mut dst = out.layer_mut(layer);
            let mut at = 0;
            for part in parts {
                let src = part.layer(layer);
                let rows = at..at + part.tokens;
                for head in 0..first.layout.kv_heads {
                    dst.head_keys(head, rows.clone())
                        .copy_from_slice(src.head_keys(head, 0..part.tokens));
                    dst.head_values(head, rows.clone())
                        .copy_from_slice(src.head_values(head, 0..part.tokens));
                }
                at += part.tokens;
            }
        }
        Ok(out)
    }

    fn layer_spans(&self, layer: usize) -> (Range<usize>, Range<usize>) {
        assert!(
            layer < self.layout.layers,
            "layer {layer} of {}",
            self.layout.layers
        );
        let size = self.layout.dtype.size_in_bytes();
        let k = self.layout.kv_heads * self.tokens * self.layout.head_dim * size;
        let v = self.layout.kv_heads * self.tokens * self.layout.head_dim_v * size;
        let base = layer * (k + v);
        (base..base + k, base + k..base + k + v)
    }
}

impl std::fmt::Debug for HostKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostKv")
            .field("layout", &self.layout)
            .field("range", &self.range())
            .field("bytes", &self.data.len())
            .finish()
    }
}

/// One sequence's keys and values over consecutive positions, with the model
/// they belong to: what [`CausalCache::export_seq`](crate::CausalCache::export_seq) returns and
/// [`CausalCache::import_seq`](crate::CausalCache::import_seq) takes.
///
/// `kv` holds positions `kv.start() .. kv.end()` of every layer: per layer, keys
/// `[kv_heads, tokens, head_dim]` and values `[kv_heads, tokens, head_dim_v]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqKv {
    /// The model that computed the keys and values.
    pub fingerprint: Fingerprint,
    /// The keys and values; token offset `i` is position `i`.
    pub kv: HostKv,
}

impl SeqKv {
    /// The positions held, `kv.start() .. kv.end()`; an
    /// [`InvalidArgument`](CacheError::InvalidArgument) error when they do not
    /// fit a [`Pos`] (the last usable position is `Pos::MAX - 1`).
    pub fn positions(&self) -> Result<Range<Pos>> {
        let pos = |offset: usize| {
            Pos::try_from(offset).map_err(|_| {
                CacheError::InvalidArgument(format!(
                    "token offsets {:?} do not fit positions (at most {})",
                    self.kv.range(),
                    Pos::MAX - 1
                ))
            })
        };
        Ok(pos(self.kv.start())?..pos(self.kv.end())?)
    }
}

/// One array of a layer's whole state on the host: `shape` (row-major, the
/// backend's own dimensions, e.g. `[batch, heads, slots, head_dim]` for a
/// rotating window's keys, `[batch, ...]` for a recurrent state), `dtype`, and
/// `data`, `shape.iter().product() * dtype.size_in_bytes()` little-endian bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct HostArray {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: DType,
    /// The elements, row-major, little-endian.
    pub data: Vec<u8>,
}

impl HostArray {
    /// An array of `shape` and `dtype` over `data`; an
    /// [`InvalidArgument`](CacheError::InvalidArgument) error when the length
    /// does not fit the shape.
    pub fn new(shape: Vec<usize>, dtype: DType, data: Vec<u8>) -> Result<Self> {
        let array = HostArray { shape, dtype, data };
        array.check()?;
        Ok(array)
    }

    /// Elements: the product of the shape (1 for a scalar).
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// Checks that `data` holds exactly the elements the shape names.
    pub fn check(&self) -> Result<()> {
        let want = self
            .shape
            .iter()
            .try_fold(self.dtype.size_in_bytes(), |acc, &d| acc.checked_mul(d));
        if want != Some(self.data.len()) {
            return Err(CacheError::InvalidArgument(format!(
                "{} bytes for an array {:?} of {}",
                self.data.len(),
                self.shape,
                self.dtype
            )));
        }
        Ok(())
    }
}

impl std::fmt::Debug for HostArray {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostArray")
            .field("shape", &self.shape)
            .field("dtype", &self.dtype)
            .field("bytes", &self.data.len())
            .finish()
    }
}

/// The whole live state of one layer cache standing at token offset `offset`,
/// on the host: what a layer that cannot cut its state into token rows (a
/// rotating window, a recurrent state) gives out
/// ([`SnapshotCache::read_state`](crate::SnapshotCache::read_state)) and takes
/// back ([`load_state`](crate::SnapshotCache::load_state)). The arrays and
/// their order are the cache's own (each cache documents them); such a state
/// is valid at exactly `offset`, never before or after.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostState {
    /// The tokens the state summarises (the cache's offset).
    pub offset: usize,
    /// The state's arrays, in the cache's order.
    pub arrays: Vec<HostArray>,
}

impl HostState {
    /// Bytes of array data held.
    pub fn bytes(&self) -> usize {
        self.arrays.iter().map(|a| a.data.len()).sum()
    }

    /// Checks every array (see [`HostArray::check`]).
    pub fn check(&self) -> Result<()> {
        self.arrays.iter().try_for_each(HostArray::check)
    }
}

/// What a [`PrefixStore::fetch`] found: keys and values for `[from, end)` of the
/// prompt, and how many tokens each tier served.
#[derive(Debug, Clone)]
pub struct Fetched {
    /// Keys and values from the requested offset to the end of the stored run.
    pub kv: HostKv,
    /// `(tier name, tokens)` for each tier that served blocks, in order.
    pub tiers: Vec<(&'static str, usize)>,
}

/// What a [`PrefixStore`] did with a submitted run or set of states.
/// Submitting never blocks: a store whose writer is behind drops the write, and
/// the caller learns it here.
#[must_use = "a dropped write is not stored: count it, retry later or say so"]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Submitted {
    /// Accepted: queued for writing, or written.
    Queued,
    /// Not stored: the store's writer queue was full (it held `queue_len`
    /// writes) or the writer had shut down (`queue_len` 0).
    Dropped {
        /// The writes waiting in the queue when this one was dropped.
        queue_len: usize,
    },
    /// Not stored: the input did not fit the store (another layout, an
    /// unaligned start, too few tokens, states that do not stand at the
    /// prefix's end), or the store keeps no such thing.
    Rejected,
}

impl Submitted {
    /// Whether the write was accepted.
    pub fn is_queued(self) -> bool {
        self == Submitted::Queued
    }
}

/// A store of token prefixes' keys and values that outlives a cache (and the
/// process): what `kvcache-store` implements, and what the prefix trie and
/// engines call.
///
/// It is keyed by the model's [`Fingerprint`], the [`Namespace`] and the tokens
/// themselves; how it cuts them into blocks, and where blocks live, is its own
/// business. Reads are bounded by a deadline and never fail: a store that cannot
/// answer in time answers `None`, and the caller recomputes. Writes return at
/// once; the store does its I/O behind the caller's back.
pub trait PrefixStore: Send + Sync {
    /// The model whose keys and values this store holds: a cache imports
    /// what [`fetch`](Self::fetch) returns only when its own fingerprint is
    /// this one.
    fn fingerprint(&self) -> Fingerprint;

    /// The layout of every value this store takes and returns.
    fn layout(&self) -> &KvLayout;

    /// The store's block size in tokens: writes start at a multiple of it.
    fn block_tokens(&self) -> usize;

    /// How many tokens at the start of `tokens` this store is known to hold,
    /// from what this process wrote or read (no I/O): callers skip submitting
    /// them. A multiple of [`block_tokens`](Self::block_tokens), or
    /// `tokens.len()` when the whole of it is held.
    fn known_prefix(&self, namespace: &Namespace, tokens: &[u32]) -> usize;

    /// How far from `from` (a multiple of the block size) this store is
    /// known to hold `tokens` without a gap, from what this process wrote or
    /// read (no I/O): at least `from`, a multiple of the block size or
    /// `tokens.len()`. A sliding-window part of a cache stores the tail of a
    /// prompt, not its start: this says which of the tail it holds. The
    /// default knows only what [`known_prefix`](Self::known_prefix) knows.
    fn known_from(&self, namespace: &Namespace, tokens: &[u32], from: usize) -> usize {
        self.known_prefix(namespace, tokens).max(from)
    }

    /// Keys and values of the longest stored prefix of `tokens`, from offset
    /// `from` on (the caller holds `[0, from)` already), or `None` when the
    /// store holds nothing past `from` or cannot say within `deadline`.
    fn fetch(
        &self,
        namespace: &Namespace,
        tokens: &[u32],
        from: usize,
        deadline: std::time::Duration,
    ) -> Option<Fetched>;

    /// Stores `kv`, the keys and values of `tokens[kv.start()..kv.end()]`, for
    /// later fetches of any prompt beginning with `tokens[..kv.end()]`.
    /// `kv.start()` must be a multiple of the block size. Returns at once,
    /// saying whether the run was accepted ([`Submitted`]).
    fn submit(&self, namespace: &Namespace, tokens: &[u32], kv: HostKv) -> Submitted;

    /// Stores whole-layer states standing at exactly `tokens.len()`: for each
    /// `(layer, state)`, the state of layer `layer` after `tokens` (so
    /// `state.offset == tokens.len()`). They serve later
    /// [`fetch_states`](Self::fetch_states) of exactly that prefix. Returns at
    /// once, saying whether they were accepted. The default stores nothing (a
    /// store of rows only) and answers [`Submitted::Rejected`].
    ///
    /// Layers that cannot cut their state into token rows (rotating windows,
    /// recurrent states) can be restored only at an offset where their whole
    /// state was stored: a prompt end, where the trie writes them.
    fn submit_states(
        &self,
        namespace: &Namespace,
        tokens: &[u32],
        states: Vec<(usize, HostState)>,
    ) -> Submitted {
        let _ = (namespace, tokens, states);
        Submitted::Rejected
    }

    /// The states stored by [`submit_states`](Self::submit_states) for exactly
    /// the prefix `tokens` (every state at offset `tokens.len()`), sorted by
    /// layer; `None` when none are stored, they are damaged, or the store
    /// cannot say within `deadline`. The default answers `None`.
    fn fetch_states(
        &self,
        namespace: &Namespace,
        tokens: &[u32],
        deadline: std::time::Duration,
    ) -> Option<Vec<(usize, HostState)>> {
        let _ = (namespace, tokens, deadline);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn numbered(layout: KvLayout, start: usize, tokens: usize) -> HostKv {
        let mut kv = HostKv::zeroed(layout, start, tokens);
        for (i, b) in kv.data.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        kv
    }

    #[test]
    fn slices_and_concat_are_inverse() {
        let layout = KvLayout {
            layers: 3,
            kv_heads: 2,
            head_dim: 4,
            head_dim_v: 2,
            dtype: DType::F16,
        };
        let kv = numbered(layout, 10, 9);
        let a = kv.slice(10..13).unwrap();
        let b = kv.slice(13..19).unwrap();
        assert_eq!((a.range(), b.range()), (10..13, 13..19));
        assert_eq!(HostKv::concat(&[&a, &b]).unwrap(), kv);
        // A slice holds exactly the rows it names, head by head.
        assert_eq!(b.layer(2).head_values(1, 0..6), kv.layer(2).head_values(1, 3..9));
        assert!(HostKv::concat(&[&b, &a]).is_err());
        assert!(kv.slice(9..12).is_err());
    }

    #[test]
    fn layouts_name_what_differs() {
        let a = KvLayout::new(30, 3, 64, DType::F32);
        let b = KvLayout {
            dtype: DType::F16,
            ..a
        };
        assert_eq!(a.token_bytes(), 30 * 3 * 128 * 4);
        match a.expect(&b) {
            Err(CacheError::LayoutMismatch { what, .. }) => assert_eq!(what, "dtype"),
            other => panic!("{other:?}"),
        }
        assert!(a.expect(&KvLayout { kv_heads: 2, ..a }).is_err());
        assert!(a.expect(&a).is_ok());
    }

    #[test]
    fn fingerprints_round_trip_hex() {
        let f = Fingerprint([0xab; 32]);
        assert_eq!(Fingerprint::from_hex(&f.to_hex()).unwrap(), f);
        assert!(Fingerprint::from_hex("zz").is_err());
        assert!(Fingerprint::from_hex(&"g".repeat(64)).is_err());
    }

    #[test]
    fn namespaces_are_validated() {
        assert!(Namespace::new("a/b+c=d:e.f_g-h").is_ok());
        for bad in ["", "has space", "semi;colon", "new\nline", "é"] {
            assert!(
                matches!(Namespace::new(bad), Err(CacheError::InvalidNamespace(_))),
                "{bad:?}"
            );
        }
        assert!(Namespace::new(&"a".repeat(Namespace::MAX_LEN)).is_ok());
        assert!(Namespace::new(&"a".repeat(Namespace::MAX_LEN + 1)).is_err());
        assert!(Namespace::from_salt(None).unwrap().is_shared());
    }
}
