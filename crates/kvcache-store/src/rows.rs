//! Cutting and joining [`HostKv`] runs in one pass each: the writer cuts a
//! submitted run into blocks, a fetch joins blocks and drops the rows before
//! `from`. Appending (rather than zero-filling then copying, as
//! [`HostKv::slice`] does) keeps each a single copy of the bytes.

use std::ops::Range;

use kvcache_api::{HostKv, KvLayout};

use crate::error::Result;

/// Token offsets `range` of the consecutive `parts` (which must cover it), as one
/// [`HostKv`].
pub(crate) fn join(layout: &KvLayout, parts: &[&HostKv], range: Range<usize>) -> Result<HostKv> {
    if parts.len() == 1 && parts[0].range() == range {
        return Ok(parts[0].clone());
    }
    let mut out = Vec::with_capacity(range.len() * layout.token_bytes());
    let elem = layout.dtype.size_in_bytes();
    for layer in 0..layout.layers {
        for (dim, is_keys) in [(layout.head_dim, true), (layout.head_dim_v, false)] {
            let row = dim * elem;
            for head in 0..layout.kv_heads {
                for part in parts {
                    let lo = range.start.max(part.start());
                    let hi = range.end.min(part.end());
                    if lo >= hi {
                        continue;
                    }
                    let rows = part.layer(layer);
                    let span = if is_keys { rows.keys } else { rows.values };
                    let base = head * part.tokens() * row;
                    let from = base + (lo - part.start()) * row;
                    out.extend_from_slice(&span[from..from + (hi - lo) * row]);
                }
            }
        }
    }
    Ok(HostKv::from_bytes(*layout, range.start, range.len(), out)?)
}

/// The bytes of token offsets `range` of `kv`, as the slices of `kv` that hold
/// them, in canonical order (layer; keys then values; head): what a block cut
/// from `kv` would hold, without copying it. `None` when `range` is not within
/// `kv` (or the layout's arithmetic does not fit its bytes).
pub(crate) fn slices(kv: &HostKv, range: Range<usize>) -> Option<Vec<&[u8]>> {
    if range.start < kv.start() || range.end > kv.end() || range.start > range.end {
        return None;
    }
    let layout = kv.layout();
    let elem = layout.dtype.size_in_bytes();
    let mut out = Vec::with_capacity(layout.layers * 2 * layout.kv_heads);
    if range.is_empty() {
        return Some(out);
    }
    for layer in 0..layout.layers {
        let rows = kv.layer(layer);
        for (dim, span) in [(layout.head_dim, rows.keys), (layout.head_dim_v, rows.values)] {
            let row = dim * elem;
            for head in 0..layout.kv_heads {
                let from = (head * kv.tokens() + (range.start - kv.start())) * row;
                out.push(span.get(from..from + range.len() * row)?);
            }
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use kvcache_api::DType;

    use super::*;

    /// The slices of a range are exactly the bytes `join` copies for it.
    #[test]
    fn slices_match_join() {
        let layout = KvLayout::new(3, 2, 4, DType::F16);
        let tokens = 10;
        let bytes: Vec<u8> = (0..tokens * layout.token_bytes())
            .map(|i| (i * 7) as u8)
            .collect();
        let kv = HostKv::from_bytes(layout, 4, tokens, bytes).unwrap();
        for range in [4..14, 4..8, 8..12, 12..14, 9..10] {
            let joined = join(&layout, &[&kv], range.clone()).unwrap();
            let cut: Vec<u8> = slices(&kv, range).unwrap().concat();
            assert_eq!(cut, joined.as_bytes());
        }
        assert!(slices(&kv, 3..8).is_none());
        assert!(slices(&kv, 10..15).is_none());
    }
}
