//! The prefix cache's invariants, checked in full after every operation in debug
//! builds and by the property tests.
use super::pool::{BlockId, BlockPool};
use super::PrefixCache;
use crate::error::CoreError;

impl PrefixCache {
    /// Every structural invariant, checked in full (for tests and debug builds).
    pub fn check_invariants(&self) -> Result<(), CoreError> {
        self.check_all()
            .map_err(|msg| CoreError::BrokenInvariant(format!("prefix cache: {msg}")))
    }

    pub(super) fn debug_check(&self) {
        if cfg!(debug_assertions) {
            if let Err(err) = self.check_invariants() {
                panic!("{err}");
            }
        }
    }

    fn check_all(&self) -> Result<(), String> {
        let on_free_list = self.check_free_list()?;
        let refs = self.check_tables()?;
        for (i, block) in self.pool.blocks.iter().enumerate() {
            if block.ref_count != refs[i] {
                return Err(format!(
                    "block {i} has {} refs, tables hold {}",
                    block.ref_count, refs[i]
                ));
            }
            if (block.ref_count == 0) != on_free_list[i] {
                return Err(format!("block {i} in use and free, or neither"));
            }
            if block.ref_count > 0
                && !(BlockPool::is_nil(block.prev) && BlockPool::is_nil(block.next))
            {
                return Err(format!("block {i} is in use with free-list links"));
            }
        }
        self.check_map()
    }

    /// Both free lists are well linked, have no block twice, hold only unreferenced
    /// blocks (the pinned one only pinned, cached blocks, the other only unpinned ones),
    /// and the ordinary one keeps empty blocks ahead of cached ones (they only come from
    /// `new` and `clear`, which leave no cached block free). Returns membership per block.
    fn check_free_list(&self) -> Result<Vec<bool>, String> {
        let pool = &self.pool;
        let mut on_free_list = vec![false; pool.len()];
        let lists = [
            (pool.free_list(), pool.free, false),
            (pool.pinned_free_list(), pool.pinned_free, true),
        ];
        for (free, list, pinned) in &lists {
            if free.len() != list.len {
                return Err(format!(
                    "free list has {} blocks, count says {}",
                    free.len(),
                    list.len
                ));
            }
            let mut seen_cached = false;
            for (pos, &i) in free.iter().enumerate() {
                let block = &pool.blocks[i as usize];
                if std::mem::replace(&mut on_free_list[i as usize], true) {
                    return Err(format!("block {i} is on a free list twice"));
                }
                if block.ref_count != 0 {
                    return Err(format!("block {i} is free with {} refs", block.ref_count));
                }
                if (block.pins > 0) != *pinned {
                    return Err(format!(
                        "block {i} with {} pins on the wrong list",
                        block.pins
                    ));
                }
                let prev = if pos == 0 { u32::MAX } else { free[pos - 1] };
                if prev != block.prev {
                    return Err(format!("block {i} has a stale prev link"));
                }
                if block.hash.is_some() {
                    seen_cached = true;
                } else if seen_cached || *pinned {
                    return Err(format!("empty block {i} behind a cached one or pinned"));
                }
            }
            if free.last().copied().unwrap_or(u32::MAX) != list.tail {
                return Err("tail is not the free list's last block".into());
            }
        }
        if lists[0].1.len + lists[1].1.len != pool.num_free {
            return Err(format!("{} free blocks counted", pool.num_free));
        }
        self.check_pins()?;
        Ok(on_free_list)
    }

    /// Every block's pin count is the number of pins holding it in RAM, each such pin
    /// holds all its blocks (with the hashes it lists), and pinned blocks stay within the
    /// cap.
    fn check_pins(&self) -> Result<(), String> {
        let pool = &self.pool;
        let mut pins = vec![0u32; pool.len()];
        for (hash, pin) in &self.pins.pins {
            if pin.hashes.last() != Some(hash) {
                return Err(format!("pin {hash:?} is not keyed by its last block"));
            }
            if !pin.in_ram() {
                continue; // held in the disk tier only
            }
            if pin.blocks.len() != pin.hashes.len() {
                return Err(format!("pin {hash:?} holds some of its blocks in RAM"));
            }
            for (&id, want) in pin.blocks.iter().zip(&pin.hashes) {
                pins[id.index()] += 1;
                if pool.blocks[id.index()].hash.as_ref() != Some(want) {
                    return Err(format!(
                        "pin {hash:?} covers {id}, which holds another block"
                    ));
                }
            }
        }
        for (i, block) in pool.blocks.iter().enumerate() {
            if block.pins != pins[i] {
                return Err(format!(
                    "block {i} has {} pins, pins cover it {}",
                    block.pins, pins[i]
                ));
            }
        }
        let pinned = pins.iter().filter(|&&n| n > 0).count();
        if pinned != pool.num_pinned {
            return Err(format!(
                "{pinned} pinned blocks, count says {}",
                pool.num_pinned
            ));
        }
        if pinned > self.pins.max_pinned {
            return Err(format!(
                "{pinned} pinned blocks over the cap {}",
                self.pins.max_pinned
            ));
        }
        Ok(())
    }

    /// Every table holds cached blocks whose last one carries the chain's hash, and
    /// its token counts agree with its blocks. Returns how many tables hold each block.
    fn check_tables(&self) -> Result<Vec<u32>, String> {
        let pool = &self.pool;
        let mut refs = vec![0u32; pool.len()];
        for (rid, table) in &self.tables {
            for &id in &table.blocks {
                let Some(r) = refs.get_mut(id.index()) else {
                    return Err(format!("{rid:?} holds {id}, out of range"));
                };
                *r += 1;
                if pool.blocks[id.index()].hash.is_none() {
                    return Err(format!("{rid:?} holds {id}, which is not cached"));
                }
            }
            let last = table
                .blocks
                .last()
                .and_then(|id| pool.blocks[id.index()].hash);
            if last != table.last_hash {
                return Err(format!("{rid:?}: the last block's hash is not the chain's"));
            }
            let full = table.blocks.len() * self.block_size;
            let consistent = if table.caching {
                table.num_tokens == full + table.partial.len()
                    && table.partial.len() < self.block_size
            } else {
                table.partial.is_empty() && table.num_tokens >= full
            };
            if !consistent {
                return Err(format!(
                    "{rid:?}: {} tokens with {} blocks and {} partial (caching: {})",
                    table.num_tokens,
                    table.blocks.len(),
                    table.partial.len(),
                    table.caching
                ));
            }
        }
        Ok(refs)
    }

    /// The hash map is a bijection with the cached blocks.
    fn check_map(&self) -> Result<(), String> {
        let pool = &self.pool;
        let mut cached = 0;
        for (i, block) in pool.blocks.iter().enumerate() {
            if let Some(hash) = &block.hash {
                cached += 1;
                if pool.by_hash.get(hash) != Some(&BlockId::new(i as u32)) {
                    return Err(format!("block {i}'s hash maps elsewhere"));
                }
            }
        }
        if cached != pool.by_hash.len() {
            return Err(format!(
                "{} map entries for {cached} cached blocks",
                pool.by_hash.len()
            ));
        }
        Ok(())
    }
}
