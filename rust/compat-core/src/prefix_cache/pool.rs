//! The block pool: an arena of blocks with refcounts, an intrusive doubly-linked LRU
//! list of the free ones (indices, no pointers), and the hash → block map.
//!
//! Eviction is lazy: a freed block keeps its hash and stays findable until it is
//! reallocated. Allocation takes the least recently freed block; reallocating a cached
//! one evicts its old hash and records `(id, old hash)` for [`BlockPool::take_evicted`].
//!
//! Pinned blocks (a `cache_control` breakpoint covers them, see `pins.rs`) wait on a
//! second free list that allocation never takes from: the prefix cache drops a pin
//! first, which moves its blocks to the back of the ordinary list.
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
    /// Live pins covering the block; a free block with pins waits on the pinned list.
    pub pins: u32,
}

/// One doubly-linked list of free blocks (head = evicted first).
#[derive(Debug, Clone, Copy)]
pub(super) struct FreeList {
    pub head: u32,
    pub tail: u32,
    pub len: usize,
}

impl FreeList {
    const EMPTY: Self = Self {
        head: NIL,
        tail: NIL,
        len: 0,
    };
}

#[derive(Debug)]
pub(super) struct BlockPool {
    pub blocks: Vec<Block>,
    /// Free unpinned blocks, least recently freed first: allocation takes the head.
    pub free: FreeList,
    /// Free pinned blocks, least recently freed first.
    pub pinned_free: FreeList,
    /// Free blocks on both lists.
    pub num_free: usize,
    /// Blocks with at least one pin, free or in use.
    pub num_pinned: usize,
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
                pins: 0,
            })
            .collect();
        Self {
            blocks,
            free: FreeList {
                head: if n == 0 { NIL } else { 0 },
                tail: if n == 0 { NIL } else { num_blocks - 1 },
                len: n,
            },
            pinned_free: FreeList::EMPTY,
            num_free: n,
            num_pinned: 0,
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
        if self.free.head == NIL {
            return None;
        }
        let id = BlockId(self.free.head);
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

    /// Adds a pin to a cached block; a free one moves to the pinned list.
    pub fn pin(&mut self, id: BlockId) {
        debug_assert!(self.blocks[id.index()].hash.is_some(), "{id} is not cached");
        let block = &self.blocks[id.index()];
        if block.pins == 0 {
            self.num_pinned += 1;
            if block.ref_count == 0 {
                self.unlink(id.0);
                self.blocks[id.index()].pins = 1;
                self.push_back(id.0);
                return;
            }
        }
        self.blocks[id.index()].pins += 1;
    }

    /// Drops a pin; a free block left without pins goes to the back of the ordinary
    /// list, still cached.
    pub fn unpin(&mut self, id: BlockId) {
        let block = &self.blocks[id.index()];
        debug_assert!(block.pins > 0, "{id} unpinned more often than pinned");
        if block.pins == 1 {
            self.num_pinned -= 1;
            if block.ref_count == 0 {
                self.unlink(id.0);
                self.blocks[id.index()].pins = 0;
                self.push_back(id.0);
                return;
            }
        }
        self.blocks[id.index()].pins -= 1;
    }

    /// Evicts every cached block nobody holds (the caller drops the pins first).
    pub fn evict_free(&mut self) {
        debug_assert_eq!(self.pinned_free.len, 0, "pinned blocks are free");
        let mut cursor = self.free.head;
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

    /// The free list a free block `i` is on (by its pins).
    fn list_of(&mut self, i: u32) -> &mut FreeList {
        if self.blocks[i as usize].pins > 0 {
            &mut self.pinned_free
        } else {
            &mut self.free
        }
    }

    fn unlink(&mut self, i: u32) {
        let Block { prev, next, .. } = self.blocks[i as usize];
        if prev != NIL {
            self.blocks[prev as usize].next = next;
        }
        if next != NIL {
            self.blocks[next as usize].prev = prev;
        }
        let list = self.list_of(i);
        if prev == NIL {
            debug_assert_eq!(list.head, i);
            list.head = next;
        }
        if next == NIL {
            debug_assert_eq!(list.tail, i);
            list.tail = prev;
        }
        list.len -= 1;
        let block = &mut self.blocks[i as usize];
        block.prev = NIL;
        block.next = NIL;
        self.num_free -= 1;
    }

    fn push_back(&mut self, i: u32) {
        let list = self.list_of(i);
        let tail = list.tail;
        if tail == NIL {
            list.head = i;
        }
        list.tail = i;
        list.len += 1;
        if tail != NIL {
            self.blocks[tail as usize].next = i;
        }
        let block = &mut self.blocks[i as usize];
        block.prev = tail;
        block.next = NIL;
        self.num_free += 1;
    }

    /// The ordinary free list from head to tail (for the invariant checks and tests).
    pub fn free_list(&self) -> Vec<u32> {
        self.walk(self.free)
    }

    /// The pinned free list from head to tail.
    pub fn pinned_free_list(&self) -> Vec<u32> {
        self.walk(self.pinned_free)
    }

    fn walk(&self, list: FreeList) -> Vec<u32> {
        let mut out = Vec::with_capacity(list.len);
        let mut cursor = list.head;
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
