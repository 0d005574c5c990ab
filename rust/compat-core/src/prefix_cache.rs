//! Prefix cache bookkeeping: which blocks of prompt K/V exist, which are cached, which
//! get evicted. Python holds the K/V tensors per [`BlockId`]; this module never sees
//! them.
//!
//! The life of a request:
//! 1. [`PrefixCache::admit`] hashes the prompt's full blocks (chained, see [`hash`]),
//!    takes references on the longest cached run from block 0 and returns its block
//!    ids: Python assembles their K/V and prefills from `cached_tokens` on. The hit is
//!    capped so that at least one prompt token is computed (its logits are needed): a
//!    prompt that is cached to its last token loses its last block.
//! 2. [`PrefixCache::append`] takes every token whose K/V has been computed (prefill
//!    chunks, then decode), in order, from `cached_tokens` on. Each block it fills is
//!    hashed and either registered in a newly allocated block (`is_new`: Python stores
//!    its K/V) or found already cached (another request filled it: Python stores
//!    nothing). When every block is in use the request stops caching; it never fails.
//! 3. [`PrefixCache::release`] drops the request's references. Its blocks stay cached
//!    on the LRU free list until reallocated, so an aborted prefill keeps what it
//!    finished.
//!
//! Reallocating a cached block evicts its old content: [`PrefixCache::take_evicted`]
//! lists such block ids so Python drops their tensors. Drain it after each `append`
//! and before storing that call's new blocks: a new block may reuse an id evicted by
//! the same call. Sampling settings never enter a hash.
//!
//! Costs are linear in the prompt's blocks with small constants, so blocks of 16
//! tokens are fine: a 128k-token prompt is 8k blocks (see `benches/prefix_cache.rs`).
use std::collections::HashMap;

use crate::error::CoreError;

pub mod hash;
mod invariants;
#[cfg(test)]
mod pin_tests;
mod pins;
mod pool;
#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;

pub use hash::{image_hash, BlockHash, BlockHasher, HashKind, MediaSpan, XXH3_SEED};
pub use pins::{PinInfo, PinSpec};
pub use pool::BlockId;
use pool::BlockPool;

/// What `admit` found: the first `cached_tokens` prompt tokens are served by
/// `block_ids` (in order, `block_size` tokens each).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admission {
    pub cached_tokens: usize,
    pub block_ids: Vec<BlockId>,
}

/// A block `append` filled: tokens `[start_token, start_token + block_size)` of the
/// request, block number `index` of its table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NewBlock {
    pub block_id: BlockId,
    pub index: usize,
    pub start_token: usize,
    /// `true`: newly registered, Python stores this block's K/V. `false`: the same
    /// content was already cached in `block_id` (another request filled it): store
    /// nothing.
    pub is_new: bool,
}

/// Counters and gauges for `/metrics` and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    pub block_size: usize,
    pub num_blocks: usize,
    /// Blocks holding cached K/V (registered in the hash map), in use or free.
    pub cached_blocks: usize,
    /// Blocks some request holds.
    pub in_use_blocks: usize,
    /// Blocks nobody holds (cached or empty): what allocation can take.
    pub free_blocks: usize,
    /// Live request tables.
    pub num_requests: usize,
    /// Prompt tokens passed to `admit`, and how many of them hit.
    pub query_tokens: u64,
    pub hit_tokens: u64,
    /// Blocks `append` registered (`is_new`), found cached already, or could not cache
    /// because every block was in use.
    pub stored_blocks: u64,
    pub deduplicated_blocks: u64,
    pub uncached_blocks: u64,
    /// Cached blocks whose content was dropped (reallocation or `clear`).
    pub evictions: u64,
}

/// One request's view: the chain of full blocks it holds and the tokens after it.
#[derive(Debug)]
struct Table {
    /// Held blocks, block 0 first; a contiguous chain from the prompt's start.
    blocks: Vec<BlockId>,
    /// Hash of the last held block (the next block's parent).
    last_hash: Option<BlockHash>,
    /// Tokens admitted from cache plus tokens appended.
    num_tokens: usize,
    /// Tokens after the last held block (fewer than a block) while caching.
    partial: Vec<u32>,
    /// Mixed into block 0's hash.
    extra: Box<[u8]>,
    /// Images in the prompt: their keys enter the hash of every block they overlap.
    media: Box<[MediaSpan]>,
    /// Cleared when a block could not be allocated: later blocks would be unreachable
    /// without it, so the request stops caching.
    caching: bool,
}

#[derive(Debug)]
pub struct PrefixCache {
    block_size: usize,
    kind: HashKind,
    pool: BlockPool,
    tables: HashMap<String, Table>,
    pins: pins::PinTable,
    stats: CacheStats,
}

impl PrefixCache {
    /// `num_blocks` blocks of `block_size` tokens, hashed with `kind`.
    pub fn new(block_size: usize, num_blocks: usize, kind: HashKind) -> Result<Self, CoreError> {
        if block_size == 0 {
            return Err(CoreError::InvalidInput(
                "block_size must be at least 1".into(),
            ));
        }
        let num_blocks = u32::try_from(num_blocks)
            .ok()
            .filter(|&n| n < u32::MAX)
            .ok_or_else(|| {
                CoreError::InvalidInput(format!("num_blocks {num_blocks} is too large"))
            })?;
        Ok(Self {
            block_size,
            kind,
            pool: BlockPool::new(num_blocks),
            tables: HashMap::new(),
            pins: pins::PinTable {
                max_pinned: num_blocks as usize / 2,
                ..pins::PinTable::default()
            },
            stats: CacheStats {
                block_size,
                num_blocks: num_blocks as usize,
                ..CacheStats::default()
            },
        })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.pool.len()
    }

    pub fn hash_kind(&self) -> HashKind {
        self.kind
    }

    /// The chained hashes of every full block of `tokens` (for cache-aware routing).
    pub fn block_hashes(&self, tokens: &[u32], extra: &[u8]) -> Result<Vec<BlockHash>, CoreError> {
        self.media_block_hashes(tokens, extra, &[])
    }

    /// [`Self::block_hashes`] of a prompt holding the images `media`.
    pub fn media_block_hashes(
        &self,
        tokens: &[u32],
        extra: &[u8],
        media: &[MediaSpan],
    ) -> Result<Vec<BlockHash>, CoreError> {
        check_extra(extra)?;
        Ok(BlockHasher::new(self.kind).chain_media(self.block_size, tokens, extra, media))
    }

    /// Prompt tokens `admit` would serve from cache now (same cap), acquiring nothing.
    pub fn lookup(&self, tokens: &[u32], extra: &[u8]) -> Result<usize, CoreError> {
        self.media_lookup(tokens, extra, &[])
    }

    /// [`Self::lookup`] of a prompt holding the images `media`.
    pub fn media_lookup(
        &self,
        tokens: &[u32],
        extra: &[u8],
        media: &[MediaSpan],
    ) -> Result<usize, CoreError> {
        check_extra(extra)?;
        Ok(self.cached_prefix(tokens, extra, media).len() * self.block_size)
    }

    /// Opens `request_id`'s table with the longest cached prefix of `tokens` (capped to
    /// leave at least one token to compute) and takes references on its blocks.
    pub fn admit(
        &mut self,
        request_id: &str,
        tokens: &[u32],
        extra: &[u8],
    ) -> Result<Admission, CoreError> {
        self.admit_media(request_id, tokens, extra, &[])
    }

    /// [`Self::admit`] of a prompt holding the images `media` (their keys also enter
    /// the blocks `append` fills later).
    pub fn admit_media(
        &mut self,
        request_id: &str,
        tokens: &[u32],
        extra: &[u8],
        media: &[MediaSpan],
    ) -> Result<Admission, CoreError> {
        if self.tables.contains_key(request_id) {
            return Err(CoreError::DuplicateRequest(request_id.to_owned()));
        }
        check_extra(extra)?;
        let hits = self.cached_prefix(tokens, extra, media);
        let block_ids: Vec<BlockId> = hits.iter().map(|&(id, _)| id).collect();
        for &id in &block_ids {
            self.pool.acquire(id);
        }
        let cached_tokens = block_ids.len() * self.block_size;
        self.stats.query_tokens += tokens.len() as u64;
        self.stats.hit_tokens += cached_tokens as u64;
        let table = Table {
            blocks: block_ids.clone(),
            last_hash: hits.last().map(|&(_, h)| h),
            num_tokens: cached_tokens,
            partial: Vec::with_capacity(self.block_size),
            extra: extra.into(),
            media: media.into(),
            caching: true,
        };
        self.tables.insert(request_id.to_owned(), table);
        self.debug_check();
        Ok(Admission {
            cached_tokens,
            block_ids,
        })
    }

    /// Records computed tokens of `request_id` (in order, after those admitted or
    /// appended before) and caches each block they fill.
    pub fn append(&mut self, request_id: &str, tokens: &[u32]) -> Result<Vec<NewBlock>, CoreError> {
        let table = self
            .tables
            .get_mut(request_id)
            .ok_or_else(|| CoreError::UnknownRequest(format!("{request_id:?}")))?;
        table.num_tokens += tokens.len();
        let mut filled = Vec::new();
        let mut hasher = BlockHasher::new(self.kind);
        let bs = self.block_size;
        let mut rest = tokens;
        while table.caching && !rest.is_empty() {
            // Hash straight from the input when a whole block is there.
            let block: &[u32] = if table.partial.is_empty() && rest.len() >= bs {
                let (block, tail) = rest.split_at(bs);
                rest = tail;
                block
            } else {
                let take = (bs - table.partial.len()).min(rest.len());
                table.partial.extend_from_slice(&rest[..take]);
                rest = &rest[take..];
                if table.partial.len() < bs {
                    break;
                }
                &table.partial
            };
            let index = table.blocks.len();
            let extra: &[u8] = if index == 0 { &table.extra } else { &[] };
            let hash = hasher.hash_media_block(
                table.last_hash.as_ref(),
                block,
                extra,
                &table.media,
                index * bs,
            );
            table.partial.clear();
            let (block_id, is_new) = if let Some(id) = self.pool.find(&hash) {
                self.pool.acquire(id);
                self.stats.deduplicated_blocks += 1;
                (id, false)
            } else if let Some(id) = self.pins.allocate(&mut self.pool, hash) {
                self.stats.stored_blocks += 1;
                (id, true)
            } else {
                self.stats.uncached_blocks += 1;
                table.caching = false;
                table.extra = Box::default();
                table.media = Box::default();
                break;
            };
            table.blocks.push(block_id);
            table.last_hash = Some(hash);
            filled.push(NewBlock {
                block_id,
                index,
                start_token: index * bs,
                is_new,
            });
        }
        self.debug_check();
        Ok(filled)
    }

    /// Closes `request_id`'s table and drops its references; its blocks stay cached.
    /// `false` if no such table is open.
    pub fn release(&mut self, request_id: &str) -> bool {
        let Some(table) = self.tables.remove(request_id) else {
            return false;
        };
        // Last block first: a chain's tail is evicted before its head, so what stays
        // cached is still a reachable prefix.
        for &id in table.blocks.iter().rev() {
            self.pool.release(id);
        }
        self.debug_check();
        true
    }

    /// Blocks whose cached content was evicted since the last call, oldest first (an id
    /// may repeat). Python drops their K/V before storing new blocks under them.
    pub fn take_evicted(&mut self) -> Vec<BlockId> {
        self.pool.take_evicted()
    }

    /// Evicts every cached block no request holds, pinned or not (they are listed by
    /// `take_evicted`).
    pub fn clear(&mut self) {
        self.drop_all_pins();
        self.pool.evict_free();
        self.debug_check();
    }

    /// Tokens `request_id` has (admitted from cache plus appended), if its table is
    /// open.
    pub fn num_tokens(&self, request_id: &str) -> Option<usize> {
        self.tables.get(request_id).map(|t| t.num_tokens)
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            cached_blocks: self.pool.num_cached(),
            in_use_blocks: self.pool.len() - self.pool.num_free,
            free_blocks: self.pool.num_free,
            num_requests: self.tables.len(),
            evictions: self.pool.num_evictions,
            ..self.stats
        }
    }

    /// The cached blocks at the start of `tokens` with their hashes, capped to leave
    /// at least one token uncached.
    fn cached_prefix(
        &self,
        tokens: &[u32],
        extra: &[u8],
        media: &[MediaSpan],
    ) -> Vec<(BlockId, BlockHash)> {
        let max_blocks = tokens.len().saturating_sub(1) / self.block_size;
        let mut hasher = BlockHasher::new(self.kind);
        let mut hits: Vec<(BlockId, BlockHash)> = Vec::new();
        for (i, block) in tokens
            .chunks_exact(self.block_size)
            .take(max_blocks)
            .enumerate()
        {
            let parent = hits.last().map(|(_, h)| h);
            let extra = if i == 0 { extra } else { &[] };
            let hash = hasher.hash_media_block(parent, block, extra, media, i * self.block_size);
            match self.pool.find(&hash) {
                Some(id) => hits.push((id, hash)),
                None => break,
            }
        }
        hits
    }
}

fn check_extra(extra: &[u8]) -> Result<(), CoreError> {
    if u32::try_from(extra.len()).is_err() {
        return Err(CoreError::InvalidInput(format!(
            "extra hash input of {} bytes is too long",
            extra.len()
        )));
    }
    Ok(())
}
