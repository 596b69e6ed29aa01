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
