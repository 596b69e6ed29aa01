//! [`KvBuffers`]: the keys/values buffers, layout and offset that
//! [`KvCache`](super::KvCache) and [`RotatingKvCache`](super::RotatingKvCache)
//! both keep.

use std::fmt;

use mlx_rs::Array;

use super::arrays::{seq_len, KvLayout};
use super::snapshot::SnapshotEncoding;

/// Keys `[B, H, capacity, Dk]` and values `[B, H, capacity, Dv]` (`None`
/// until the first write), the layout they were written with, the offset and
/// the growth step, and how snapshots keep what they copy.
pub(crate) struct KvBuffers {
    pub(crate) keys: Option<Array>,
    pub(crate) values: Option<Array>,
    pub(crate) layout: Option<KvLayout>,
    pub(crate) offset: usize,
    pub(crate) step: usize,
    pub(crate) encoding: SnapshotEncoding,
}

impl KvBuffers {
    /// Empty buffers growing in steps of `step` positions.
    pub(crate) fn new(step: usize) -> Self {
        KvBuffers {
            keys: None,
            values: None,
            layout: None,
            offset: 0,
            step,
            encoding: SnapshotEncoding::Full,
        }
    }

    /// Positions the buffers hold room for (0 when empty).
    pub(crate) fn capacity(&self) -> usize {
        self.keys.as_ref().map_or(0, seq_len)
    }

    /// The buffers themselves, keys then values (nothing when empty).
    pub(crate) fn arrays(&self) -> Vec<Array> {
        self.keys.iter().chain(self.values.iter()).cloned().collect()
    }

    /// Drops the buffers and the layout; the offset becomes 0 (the step and
    /// the snapshot encoding stay).
    pub(crate) fn clear(&mut self) {
        let encoding = self.encoding;
        *self = KvBuffers::new(self.step);
        self.encoding = encoding;
    }
}

impl fmt::Debug for KvBuffers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvBuffers")
            .field("offset", &self.offset)
            .field("capacity", &self.capacity())
            .field("step", &self.step)
            .field("encoding", &self.encoding)
            .field("layout", &self.layout)
            .finish()
    }
}
