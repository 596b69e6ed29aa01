//! The tails index: for a parent key (the block before a tail, or
//! [`BlockKey::ROOT`]) in a namespace, the lengths of the tails stored after it.
//! A lookup that has walked every full block consults it to find the partial
//! last block of a stored run.

use std::collections::{BTreeSet, HashMap};

use kvcache_api::Namespace;

use crate::keys::BlockKey;

/// Tail lengths by `(namespace, parent)`.
#[derive(Debug, Default)]
pub(crate) struct TailsIndex {
    map: HashMap<(Namespace, BlockKey), BTreeSet<usize>>,
}

impl TailsIndex {
    /// Records a tail of `len` tokens after `parent`.
    pub(crate) fn add(&mut self, namespace: &Namespace, parent: BlockKey, len: usize) {
        self.map
            .entry((namespace.clone(), parent))
            .or_default()
            .insert(len);
    }

    /// Forgets the tail of `len` tokens after `parent`.
    pub(crate) fn remove(&mut self, namespace: &Namespace, parent: BlockKey, len: usize) {
        let key = (namespace.clone(), parent);
        if let Some(set) = self.map.get_mut(&key) {
            set.remove(&len);
            if set.is_empty() {
                self.map.remove(&key);
            }
        }
    }

    /// The tail lengths after `parent`, shortest first.
    pub(crate) fn get(&self, namespace: &Namespace, parent: BlockKey) -> Vec<usize> {
        self.map
            .get(&(namespace.clone(), parent))
            .map(|set| set.iter().copied().collect())
            .unwrap_or_default()
    }
}
