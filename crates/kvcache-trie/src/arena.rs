//! Node storage: a `Vec` of nodes addressed by `u32` indices, with a free list.
//!
//! Invariants (checked by [`PrefixCache::check`](super::PrefixCache::check)):
//! - slot [`ROOT`] always holds the live root of the shared namespace, whose
//!   edge is empty (`[0, 0)`); every other namespace's root is a node like it
//!   (no parent, empty edge) in some other slot;
//! - a live node's `children` are sorted by their first edge token, with no
//!   duplicates, and each entry's token is the child's first token;
//! - a dead slot is on the free list exactly once and owns no snapshots.

use std::cmp::Reverse;

use kvcache_api::BoxedSnapshot;

/// Index of a node in the arena.
pub(crate) type NodeId = u32;

/// The shared namespace's root slot.
pub(crate) const ROOT: NodeId = 0;

/// "No node" (the root's parent).
pub(crate) const NONE: NodeId = NodeId::MAX;

/// What evicting a candidate costs, cheapest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Cost {
    /// An ordinary node with one requested child, holding whole-state
    /// snapshots (a window, a recurrent state): merging it into the child
    /// frees those and loses no path (the child's state supersedes them, and
    /// the rows of the other layers move down with it).
    Superseded,
    /// A node of generated tokens that no prompt has asked for yet (a reply
    /// the client may never send back): rebuilding it costs at most its own
    /// tokens.
    Generated,
    /// Anything else.
    Requested,
}

/// Ordering key of an eviction candidate: user nodes last; before them, the
/// cheapest [`Cost`] first; then oldest first, deepest (largest end offset)
/// first, largest first; the id breaks ties.
pub(crate) type EvictKey = (bool, Cost, u64, Reverse<usize>, Reverse<usize>, NodeId);

/// One trie node: the edge `tokens` leading to it covers offsets `[start, end)`.
pub(crate) struct Node {
    pub tokens: Vec<u32>,
    pub start: usize,
    pub end: usize,
    pub parent: NodeId,
    /// `(first token of the child's edge, child)`, sorted by token.
    pub children: Vec<(u32, NodeId)>,
    /// Per-layer snapshots restoring the cache to `end`. Empty, or one entry per layer.
    pub snaps: Vec<Option<BoxedSnapshot>>,
    /// Number of `Some` entries in `snaps`.
    pub n_snaps: usize,
    /// Sum of the snapshots' `size_bytes`.
    pub bytes: usize,
    /// An explicit restore point: never auto-merged, evicted after every other node.
    pub user: bool,
    /// The edge holds only generated tokens that no prompt has matched yet (a
    /// reply the client may never send back): evicted before requested nodes.
    pub generated: bool,
    /// Logical time of the last use.
    pub stamp: u64,
    /// On the active path (backed by the live caches).
    pub active: bool,
    /// The slot holds a node (false on the free list).
    pub live: bool,
    /// The key under which the node sits in the eviction index, if it is a candidate.
    pub key: Option<EvictKey>,
}

impl Node {
    pub fn new(tokens: Vec<u32>, start: usize, parent: NodeId, stamp: u64) -> Self {
        let end = start + tokens.len();
        Node {
            tokens,
            start,
            end,
            parent,
            children: Vec::new(),
            snaps: Vec::new(),
            n_snaps: 0,
            bytes: 0,
            user: false,
            generated: false,
            stamp,
            active: false,
            live: true,
            key: None,
        }
    }

    /// True for a namespace's root (no parent, empty edge at offset 0).
    pub fn is_root(&self) -> bool {
        self.parent == NONE
    }

    /// True when every one of `layers` layers has a snapshot.
    pub fn has_all_snaps(&self, layers: usize) -> bool {
        self.n_snaps == layers
    }

    /// The snapshot of `layer`, if any.
    pub fn snap(&self, layer: usize) -> Option<&BoxedSnapshot> {
        self.snaps.get(layer).and_then(Option::as_ref)
    }

    /// Index in `children` of the child whose edge starts with `token`.
    pub fn child_slot(&self, token: u32) -> Result<usize, usize> {
        self.children.binary_search_by_key(&token, |&(t, _)| t)
    }

    /// The child whose edge starts with `token`.
    pub fn child(&self, token: u32) -> Option<NodeId> {
        self.child_slot(token).ok().map(|i| self.children[i].1)
    }
}

/// The node arena.
pub(crate) struct Arena {
    pub nodes: Vec<Node>,
    pub free: Vec<NodeId>,
    pub live: usize,
}

impl Arena {
    /// An arena holding only the root, which is always on the active path.
    pub fn new() -> Self {
        let mut root = Node::new(Vec::new(), 0, NONE, 0);
        root.active = true;
        Arena {
            nodes: vec![root],
            free: Vec::new(),
            live: 1,
        }
    }

    #[inline]
    pub fn get(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }

    #[inline]
    pub fn get_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.nodes[id as usize]
    }

    /// Stores `node` in a free slot (or a new one) and returns its id.
    pub fn alloc(&mut self, node: Node) -> NodeId {
        self.live += 1;
        match self.free.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                let id = NodeId::try_from(self.nodes.len()).expect("more than u32::MAX trie nodes");
                assert!(id != NONE, "more than u32::MAX trie nodes");
                self.nodes.push(node);
                id
            }
        }
    }

    /// Frees `id`'s slot and hands back what it held (snapshots included).
    pub fn release(&mut self, id: NodeId) -> Node {
        debug_assert!(id != ROOT, "the root is never released");
        let mut dead = Node::new(Vec::new(), 0, NONE, 0);
        dead.live = false;
        self.live -= 1;
        self.free.push(id);
        std::mem::replace(&mut self.nodes[id as usize], dead)
    }

    /// Adds `child` under `parent`, keyed by `first`, which no sibling may start with.
    pub fn add_child(&mut self, parent: NodeId, first: u32, child: NodeId) {
        let p = self.get_mut(parent);
        match p.child_slot(first) {
            Ok(_) => panic!("node {parent} already has a child starting with token {first}"),
            Err(i) => p.children.insert(i, (first, child)),
        }
    }

    /// Removes the child keyed by `first` from `parent`.
    pub fn remove_child(&mut self, parent: NodeId, first: u32) {
        let p = self.get_mut(parent);
        let i = p.child_slot(first).expect("child to remove is missing");
        p.children.remove(i);
    }

    /// Points the child entry keyed by `first` at `child` instead.
    pub fn replace_child(&mut self, parent: NodeId, first: u32, child: NodeId) {
        let p = self.get_mut(parent);
        let i = p.child_slot(first).expect("child to replace is missing");
        p.children[i].1 = child;
    }
}

/// Length of the common prefix of `a` and `b`.
#[inline]
pub(crate) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    const CHUNK: usize = 16;
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut i = 0;
    // Whole chunks compare as one memcmp each; the tail element by element.
    while i + CHUNK <= n && a[i..i + CHUNK] == b[i..i + CHUNK] {
        i += CHUNK;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_prefix_lengths() {
        let a: Vec<u32> = (0..100).collect();
        let mut b = a.clone();
        assert_eq!(common_prefix(&a, &b), 100);
        b[37] = 1000;
        assert_eq!(common_prefix(&a, &b), 37);
        b[3] = 1000;
        assert_eq!(common_prefix(&a, &b), 3);
        assert_eq!(common_prefix(&a[..10], &a), 10);
        assert_eq!(common_prefix(&[], &a), 0);
        let c: Vec<u32> = (0..33).collect();
        assert_eq!(common_prefix(&c, &a), 33);
    }

    #[test]
    fn free_list_reuses_slots() {
        let mut arena = Arena::new();
        let a = arena.alloc(Node::new(vec![1], 0, ROOT, 0));
        let b = arena.alloc(Node::new(vec![2], 0, ROOT, 0));
        assert_eq!((a, b, arena.live), (1, 2, 3));
        let old = arena.release(a);
        assert_eq!(old.tokens, vec![1]);
        assert!(!arena.get(a).live);
        let c = arena.alloc(Node::new(vec![3], 0, ROOT, 0));
        assert_eq!((c, arena.live, arena.nodes.len()), (a, 3, 3));
    }
}
