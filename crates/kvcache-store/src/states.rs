//! Whole layer states ([`HostState`]) in the store: the states of layers that
//! cannot cut their state into token rows (rotating windows, recurrent states),
//! standing at exactly the end of one prefix.
//!
//! **Keys.** The states a [`submit_states`](kvcache_api::PrefixStore::submit_states)
//! gives for `tokens` form one entry, keyed by the prefix they stand at: the
//! key of `tokens`' last block in the block key chain (a partial last block
//! keyed as a tail, see [`keys`](crate::keys)), so within one model and one
//! namespace, hashed again under its own domain tag [`DOMAIN`] with the scope,
//! the token count and a part number. An entry can only ever be found by a
//! fetch of exactly the same tokens in the same scope.
//!
//! **Entries.** The entry is encoded as one byte string (below) and stored as
//! one or more *parts*, each an ordinary [`Block`](crate::Block) whose rows carry the bytes
//! (zero-padded to whole tokens, at most `block_tokens` tokens per part), with
//! [`STATE_PARENT`] as parent. So every tier stores, budgets, evicts (LRU),
//! checksums and promotes states exactly as it does rows, and no tier needed a
//! new entry format. A part is never mistaken for rows: its key is hashed under
//! another domain, and no block chain leads to its parent.
//!
//! **Encoding**, little-endian: `u64` payload length, the payload, `u32` CRC32
//! of the payload. Payload: `b"KVST"`, `u32` version (1), `u32` state count;
//! per state `u32` layer, `u64` offset, `u32` array count; per array `u8`
//! dtype (0 f32, 1 f16, 2 bf16), `u32` rank, `u64` per dimension, `u64` byte
//! length, the bytes. Anything that does not decode exactly (truncated, a bad
//! checksum, a length that does not fit its shape, trailing bytes) is a miss.

use kvcache_api::{DType, HostArray, HostState, KvLayout};
use sha2::{Digest, Sha256};

use crate::keys::{BlockKey, KeyChain};
use crate::namespace::Scope;

/// The domain tag of state part keys (bump it when the encoding changes).
pub const DOMAIN: &[u8] = b"kvcache-store/state/v1";

/// The parent key of every state part: a digest no block chain produces.
pub const STATE_PARENT: BlockKey = BlockKey(*b"kvcache-store/state-parent/v1\0\0\0");

const MAGIC: &[u8; 4] = b"KVST";
const VERSION: u32 = 1;
/// The largest rank accepted when decoding.
const MAX_RANK: u32 = 16;

/// The key of the prefix `tokens` (non-empty) in the block key chain: its last
/// full block's key, or the key of its partial last block as a tail.
pub fn prefix_key(scope: Scope<'_>, block_tokens: usize, tokens: &[u32]) -> BlockKey {
    let mut chain = KeyChain::new(scope, block_tokens, tokens);
    for _ in chain.by_ref() {}
    match chain.remaining() {
        0 => chain.parent(),
        rest => chain.tail_key(rest).unwrap_or_else(|| chain.parent()),
    }
}

/// The key of part `part` of the states standing at the end of `tokens`.
pub fn part_key(scope: Scope<'_>, block_tokens: usize, tokens: &[u32], part: u32) -> BlockKey {
    let prefix = prefix_key(scope, block_tokens, tokens);
    part_key_of(&scope, &prefix, tokens.len(), part)
}

/// [`part_key`] from the prefix's key.
pub(crate) fn part_key_of(scope: &Scope<'_>, prefix: &BlockKey, tokens: usize, part: u32) -> BlockKey {
    let mut hasher = Sha256::new();
    hasher.update(DOMAIN);
    scope.hash_into(&mut hasher);
    hasher.update(prefix.0);
    hasher.update((tokens as u64).to_le_bytes());
    hasher.update(part.to_le_bytes());
    BlockKey(hasher.finalize().into())
}

/// Bytes one part carries: a full block of `layout`'s rows.
pub(crate) fn part_bytes(layout: &KvLayout, block_tokens: usize) -> usize {
    (block_tokens * layout.token_bytes()).max(1)
}

/// Parts needed for an encoded entry of `len` bytes.
pub(crate) fn parts_for(len: usize, part: usize) -> usize {
    len.div_ceil(part).max(1)
}

fn dtype_code(dtype: DType) -> u8 {
    match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
    }
}

fn dtype_of(code: u8) -> Option<DType> {
    match code {
        0 => Some(DType::F32),
        1 => Some(DType::F16),
        2 => Some(DType::BF16),
        _ => None,
    }
}

/// The encoded entry of `states` (see the module docs).
pub fn encode(states: &[(usize, HostState)]) -> Vec<u8> {
    let mut payload = Vec::with_capacity(64 + states.iter().map(|(_, s)| s.bytes()).sum::<usize>());
    payload.extend_from_slice(MAGIC);
    payload.extend_from_slice(&VERSION.to_le_bytes());
    payload.extend_from_slice(&(states.len() as u32).to_le_bytes());
    for (layer, state) in states {
        payload.extend_from_slice(&(*layer as u32).to_le_bytes());
        payload.extend_from_slice(&(state.offset as u64).to_le_bytes());
        payload.extend_from_slice(&(state.arrays.len() as u32).to_le_bytes());
        for array in &state.arrays {
            payload.push(dtype_code(array.dtype));
            payload.extend_from_slice(&(array.shape.len() as u32).to_le_bytes());
            for &d in &array.shape {
                payload.extend_from_slice(&(d as u64).to_le_bytes());
            }
            payload.extend_from_slice(&(array.data.len() as u64).to_le_bytes());
            payload.extend_from_slice(&array.data);
        }
    }
    let mut out = Vec::with_capacity(payload.len() + 12);
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&payload);
    out.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    out
}

/// The length of the encoded entry that `head` (its first bytes, at least 8)
/// begins, if it can be one.
pub(crate) fn encoded_len(head: &[u8]) -> Option<usize> {
    let len = u64::from_le_bytes(head.get(..8)?.try_into().ok()?);
    usize::try_from(len).ok()?.checked_add(12)
}

/// A cursor over bytes that fails instead of reading past the end.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.bytes.split_at_checked(n)?;
        self.bytes = rest;
        Some(head)
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn usize(&mut self) -> Option<usize> {
        usize::try_from(self.u64()?).ok()
    }
}

/// The states of an encoded entry, exactly `bytes` long; `None` for anything
/// damaged (see the module docs).
pub fn decode(bytes: &[u8]) -> Option<Vec<(usize, HostState)>> {
    let mut outer = Reader { bytes };
    let len = outer.usize()?;
    let payload = outer.take(len)?;
    let crc = outer.u32()?;
    if !outer.bytes.is_empty() || crc32fast::hash(payload) != crc {
        return None;
    }
    let mut r = Reader { bytes: payload };
    if r.take(4)? != MAGIC || r.u32()? != VERSION {
        return None;
    }
    let count = r.u32()?;
    let mut states = Vec::new();
    for _ in 0..count {
        let layer = r.u32()? as usize;
        let offset = r.usize()?;
        let arrays = r.u32()?;
        let mut state = HostState {
            offset,
            arrays: Vec::new(),
        };
        for _ in 0..arrays {
            let dtype = dtype_of(r.u8()?)?;
            let rank = r.u32()?;
            if rank > MAX_RANK {
                return None;
            }
            let shape = (0..rank).map(|_| r.usize()).collect::<Option<Vec<_>>>()?;
            let n = r.usize()?;
            let data = r.take(n)?.to_vec();
            state.arrays.push(HostArray::new(shape, dtype, data).ok()?);
        }
        states.push((layer, state));
    }
    r.bytes.is_empty().then_some(states)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<(usize, HostState)> {
        let array = |shape: Vec<usize>, dtype: DType, seed: u8| {
            let n = shape.iter().product::<usize>() * dtype.size_in_bytes();
            HostArray::new(
                shape,
                dtype,
                (0..n).map(|i| (i as u8).wrapping_mul(seed)).collect(),
            )
            .unwrap()
        };
        vec![
            (
                1,
                HostState {
                    offset: 9,
                    arrays: vec![
                        array(vec![1, 2, 3, 4], DType::F32, 3),
                        array(vec![], DType::BF16, 5),
                    ],
                },
            ),
            (
                4,
                HostState {
                    offset: 9,
                    arrays: vec![array(vec![2, 0], DType::F16, 7)],
                },
            ),
        ]
    }

    #[test]
    fn encoding_round_trips_and_rejects_damage() {
        let states = sample();
        let bytes = encode(&states);
        assert_eq!(encoded_len(&bytes), Some(bytes.len()));
        assert_eq!(decode(&bytes), Some(states));
        for cut in [0, 7, 8, 20, bytes.len() - 1] {
            assert_eq!(decode(&bytes[..cut]), None, "truncated to {cut}");
        }
        for at in [8, 20, bytes.len() / 2, bytes.len() - 1] {
            let mut bad = bytes.clone();
            bad[at] ^= 0x40;
            assert_eq!(decode(&bad), None, "flipped byte {at}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(decode(&longer), None);
    }
}
