//! What this process believes the store holds: keys it wrote or read, forgotten
//! when every tier misses them, capped in number (oldest forgotten first).
//! [`PrefixStore::known_prefix`](kvcache_api::PrefixStore::known_prefix) answers
//! from it without I/O.

use std::sync::{Mutex, MutexGuard};

use crate::keys::BlockKey;
use crate::lru::Lru;

/// Keys believed present.
#[derive(Debug)]
pub(crate) struct KnownKeys {
    keys: Mutex<Lru<BlockKey>>,
    capacity: usize,
}

impl KnownKeys {
    /// An empty set remembering at most `capacity` keys.
    pub(crate) fn new(capacity: usize) -> Self {
        KnownKeys {
            keys: Mutex::new(Lru::new()),
            capacity: capacity.max(1),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Lru<BlockKey>> {
        self.keys.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Remembers `key` as present.
    pub(crate) fn insert(&self, key: BlockKey) {
        let mut keys = self.lock();
        keys.insert(key, 1);
        while keys.len() > self.capacity {
            keys.pop_oldest();
        }
    }

    /// Forgets `key`.
    pub(crate) fn forget(&self, key: &BlockKey) {
        self.lock().remove(key);
    }

    /// Whether `key` is believed present.
    pub(crate) fn contains(&self, key: &BlockKey) -> bool {
        self.lock().contains(key)
    }
}
