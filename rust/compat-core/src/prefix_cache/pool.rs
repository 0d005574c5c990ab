//! The block pool: an arena of blocks with refcounts, an intrusive doubly-linked LRU
//! list of the free ones (indices, no pointers), and the hash → block map.
//!
//! Eviction is lazy: a freed block keeps its hash and stays findable until it is
//! reallocated. Allocation takes the least recently freed block; reallocating a cached
//! one evicts its old hash and records `(id, old hash)` for [`BlockPool::take_evicted`].
use std::collections::HashMap;
use std::fmt;

use super::hash::BlockHash;

/// A block in the pool; Python keys its K/V tensors by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(u32);

impl BlockId {
    pub const fn new(index: u32) -> Self {
        Self(index)
    }

    pub const fn get(self) -> u32 {
        self.0
    }

    pub(super) const fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "block {}", self.0)
    }
}

/// End of the free list.
const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub(super) struct Block {
    /// Set while the block is registered in the map (its K/V is cached).
    pub hash: Option<BlockHash>,
    /// Request tables holding the block; 0 means it is on the free list.
    pub ref_count: u32,
    /// Free-list links (towards the head = evicted first); NIL at the ends and
    /// while in use.
    pub prev: u32,
    pub next: u32,
}

#[derive(Debug)]
pub(super) struct BlockPool {
    pub blocks: Vec<Block>,
    /// Least recently freed; allocation takes from here.
    pub head: u32,
    /// Most recently freed.
    pub tail: u32,
    pub num_free: usize,
    pub by_hash: HashMap<BlockHash, BlockId>,
    /// Evictions since the last drain: the block and the hash it lost.
    pub evicted: Vec<(BlockId, BlockHash)>,
    pub num_evictions: u64,
}

impl BlockPool {
    /// `num_blocks` empty blocks, all free, in id order. `num_blocks < u32::MAX`.
    pub fn new(num_blocks: u32) -> Self {
        debug_assert!(num_blocks < NIL);
        let n = num_blocks as usize;
        let blocks = (0..num_blocks)
            .map(|i| Block {
                hash: None,
                ref_count: 0,
                prev: if i == 0 { NIL } else { i - 1 },
                next: if i + 1 == num_blocks { NIL } else { i + 1 },
            })
            .collect();
        Self {
            blocks,
            head: if n == 0 { NIL } else { 0 },
            tail: if n == 0 { NIL } else { num_blocks - 1 },
            num_free: n,
            by_hash: HashMap::with_capacity(n),
            evicted: Vec::new(),
            num_evictions: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn num_cached(&self) -> usize {
        self.by_hash.len()
    }

    pub fn find(&self, hash: &BlockHash) -> Option<BlockId> {
        self.by_hash.get(hash).copied()
    }

    /// Takes a reference, pulling the block off the free list if it was free.
    pub fn acquire(&mut self, id: BlockId) {
        debug_assert!(self.blocks[id.index()].hash.is_some(), "{id} is not cached");
        if self.blocks[id.index()].ref_count == 0 {
            self.unlink(id.0);
        }
        self.blocks[id.index()].ref_count += 1;
    }

    /// Drops a reference; a block nobody holds goes to the back of the free list,
    /// still cached.
    pub fn release(&mut self, id: BlockId) {
        let block = &mut self.blocks[id.index()];
        debug_assert!(
            block.ref_count > 0,
            "{id} released more often than acquired"
        );
        block.ref_count -= 1;
        if block.ref_count == 0 {
            self.push_back(id.0);
        }
    }

    /// Registers `hash` in the least recently freed block (evicting what it cached)
    /// and takes a reference; `None` when every block is in use.
    pub fn allocate(&mut self, hash: BlockHash) -> Option<BlockId> {
        debug_assert!(!self.by_hash.contains_key(&hash), "{hash:?} is cached");
        if self.head == NIL {
            return None;
        }
        let id = BlockId(self.head);
        self.unlink(id.0);
        let block = &mut self.blocks[id.index()];
        if let Some(old) = block.hash.replace(hash) {
            let removed = self.by_hash.remove(&old);
            debug_assert_eq!(removed, Some(id), "map out of sync");
            self.evicted.push((id, old));
            self.num_evictions += 1;
        }
        block.ref_count = 1;
        self.by_hash.insert(hash, id);
        Some(id)
    }

    /// Evicts every cached block nobody holds.
    pub fn evict_free(&mut self) {
        let mut cursor = self.head;
        while cursor != NIL {
            let block = &mut self.blocks[cursor as usize];
            if let Some(old) = block.hash.take() {
                self.by_hash.remove(&old);
                self.evicted.push((BlockId(cursor), old));
                self.num_evictions += 1;
            }
            cursor = block.next;
        }
    }

    pub fn take_evicted(&mut self) -> Vec<BlockId> {
        self.evicted.drain(..).map(|(id, _)| id).collect()
    }

    fn unlink(&mut self, i: u32) {
        let Block { prev, next, .. } = self.blocks[i as usize];
        if prev == NIL {
            debug_assert_eq!(self.head, i);
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            debug_assert_eq!(self.tail, i);
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let block = &mut self.blocks[i as usize];
        block.prev = NIL;
        block.next = NIL;
        self.num_free -= 1;
    }

    fn push_back(&mut self, i: u32) {
        let tail = self.tail;
        {
            let block = &mut self.blocks[i as usize];
            block.prev = tail;
            block.next = NIL;
        }
        if tail == NIL {
            self.head = i;
        } else {
            self.blocks[tail as usize].next = i;
        }
        self.tail = i;
        self.num_free += 1;
    }

    /// The free list from head to tail (for the invariant checks and tests).
    pub fn free_list(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.num_free);
        let mut cursor = self.head;
        while cursor != NIL && out.len() <= self.blocks.len() {
            out.push(cursor);
            cursor = self.blocks[cursor as usize].next;
        }
        out
    }

    /// Whether a free-list link is the end marker.
    pub fn is_nil(link: u32) -> bool {
        link == NIL
    }
}

#[cfg(test)]
mod tests {
    use super::super::hash::{BlockHasher, HashKind};
    use super::*;

    fn hashes(n: u32) -> Vec<BlockHash> {
        let mut h = BlockHasher::new(HashKind::Xxh3);
        (0..n).map(|i| h.hash_block(None, &[i], b"")).collect()
    }

    #[test]
    fn allocation_is_lru_and_eviction_lazy() {
        let mut pool = BlockPool::new(3);
        let h = hashes(5);
        let ids: Vec<_> = h[..3].iter().map(|&x| pool.allocate(x).unwrap()).collect();
        assert_eq!(ids, [BlockId(0), BlockId(1), BlockId(2)]);
        assert_eq!(pool.allocate(h[3]), None, "all in use");
        // Freed in the order 1, 0, 2: still cached, evicted in that order.
        for i in [1, 0, 2] {
            pool.release(ids[i]);
        }
        assert_eq!(pool.free_list(), [1, 0, 2]);
        assert_eq!(pool.find(&h[1]), Some(BlockId(1)));
        assert_eq!(pool.allocate(h[3]), Some(BlockId(1)));
        assert_eq!(pool.find(&h[1]), None);
        // Touching block 0 moves it out of the free list; block 2 goes next.
        pool.acquire(BlockId(0));
        assert_eq!(pool.allocate(h[4]), Some(BlockId(2)));
        assert_eq!(pool.take_evicted(), [BlockId(1), BlockId(2)]);
        assert!(pool.take_evicted().is_empty());
        assert_eq!(
            (pool.num_free, pool.num_evictions, pool.num_cached()),
            (0, 2, 3)
        );
    }

    #[test]
    fn evict_free_keeps_blocks_in_use() {
        let mut pool = BlockPool::new(2);
        let h = hashes(2);
        let a = pool.allocate(h[0]).unwrap();
        let b = pool.allocate(h[1]).unwrap();
        pool.release(b);
        pool.evict_free();
        assert_eq!(pool.find(&h[0]), Some(a));
        assert_eq!(pool.find(&h[1]), None);
        assert_eq!(pool.take_evicted(), [b]);
        assert_eq!(pool.num_free, 1);
    }
}
