//! A least-recently-used order over keys with a size each: what the memory and
//! disk tiers evict by. Plain bookkeeping, no I/O.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

/// Keys in order of last use, with their sizes and the running total.
#[derive(Debug)]
pub(crate) struct Lru<K> {
    entries: HashMap<K, (u64, u64)>,
    order: BTreeMap<u64, K>,
    clock: u64,
    total: u64,
}

impl<K: Hash + Eq + Clone> Lru<K> {
    /// An empty order.
    pub(crate) fn new() -> Self {
        Lru {
            entries: HashMap::new(),
            order: BTreeMap::new(),
            clock: 0,
            total: 0,
        }
    }

    /// Adds `key` (or replaces its size) as the most recently used.
    pub(crate) fn insert(&mut self, key: K, size: u64) {
        self.remove(&key);
        self.clock += 1;
        self.order.insert(self.clock, key.clone());
        self.entries.insert(key, (self.clock, size));
        self.total += size;
    }

    /// Marks `key` as just used; false if it is absent.
    pub(crate) fn touch(&mut self, key: &K) -> bool {
        let Some(entry) = self.entries.get_mut(key) else {
            return false;
        };
        self.order.remove(&entry.0);
        self.clock += 1;
        entry.0 = self.clock;
        self.order.insert(self.clock, key.clone());
        true
    }

    /// Removes `key`, returning its size.
    pub(crate) fn remove(&mut self, key: &K) -> Option<u64> {
        let (tick, size) = self.entries.remove(key)?;
        self.order.remove(&tick);
        self.total -= size;
        Some(size)
    }

    /// Removes and returns the least recently used key and its size.
    pub(crate) fn pop_oldest(&mut self) -> Option<(K, u64)> {
        let (_, key) = self.order.pop_first()?;
        let (_, size) = self.entries.remove(&key)?;
        self.total -= size;
        Some((key, size))
    }

    /// Whether `key` is held.
    pub(crate) fn contains(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    /// The sum of the sizes held.
    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    /// Keys held.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Keys from least to most recently used.
    pub(crate) fn keys(&self) -> impl Iterator<Item = &K> {
        self.order.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used_first() {
        let mut lru = Lru::new();
        lru.insert("a", 10);
        lru.insert("b", 20);
        lru.insert("c", 30);
        assert!(lru.touch(&"a"));
        assert_eq!(lru.total(), 60);
        assert_eq!(lru.pop_oldest(), Some(("b", 20)));
        assert_eq!(lru.pop_oldest(), Some(("c", 30)));
        lru.insert("a", 5);
        assert_eq!((lru.total(), lru.len()), (5, 1));
        assert_eq!(lru.remove(&"a"), Some(5));
        assert_eq!((lru.total(), lru.pop_oldest()), (0, None));
    }
}
