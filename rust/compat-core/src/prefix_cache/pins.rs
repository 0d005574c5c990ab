//! Cache breakpoints that hold: a `cache_control` breakpoint pins the full blocks of
//! the prompt up to it for its TTL (Anthropic's `5m` or `1h`; each request that carries
//! it again refreshes it).
//!
//! A pin is keyed by the chained hash of its last block, so the same prefix pinned by
//! many turns is one pin. Pinned blocks that nobody holds wait on the pool's pinned free
//! list: allocation takes every unpinned block first, then drops the pin that expires
//! first and takes its blocks. Pins that together cover more than `pin_fraction` of the
//! pool are dropped the same way, earliest expiry first, so pins never starve requests
//! of blocks. Time is the caller's clock (seconds), so the module stays deterministic.
//!
//! A pin RAM had to let go of still holds in the disk tier until it expires: it keeps
//! its blocks' hashes, which [`PrefixCache::pinned_blocks`] lists for the disk tier's
//! eviction, and a later request that pins the same prefix again (a hit read back from
//! disk) holds it in RAM once more.
use std::collections::HashMap;

use super::hash::BlockHash;
use super::pool::{BlockId, BlockPool};
use super::PrefixCache;
use crate::error::CoreError;

/// A request's breakpoint: pin its full blocks up to token `end_token` for `ttl_secs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinSpec {
    pub end_token: usize,
    pub ttl_secs: u32,
}

/// A live pin, for `/v1/status`.
#[derive(Debug, Clone, PartialEq)]
pub struct PinInfo {
    /// The chained hash of the last pinned block.
    pub hash: BlockHash,
    pub tokens: usize,
    /// The longest TTL any breakpoint asked of it.
    pub ttl_secs: u32,
    pub expires_at: f64,
}

#[derive(Debug)]
pub(super) struct Pin {
    /// The chained hashes of the pinned blocks, block 0 first (what the disk tier keeps).
    pub hashes: Vec<BlockHash>,
    /// The pool blocks holding them while the pin holds them in RAM (one per hash);
    /// empty once RAM needed them back: the pin then holds in the disk tier only.
    pub blocks: Vec<BlockId>,
    pub ttl_secs: u32,
    pub expires_at: f64,
}

/// Live pins by the hash of their last block.
#[derive(Debug, Default)]
pub(super) struct PinTable {
    pub pins: HashMap<BlockHash, Pin>,
    /// Pinned blocks may cover at most this many pool blocks.
    pub max_pinned: usize,
    /// Pins RAM let go of before expiry to make room (allocation or the cap).
    pub dropped: u64,
    /// Moves on whenever what `pinned_blocks` lists may change (a pin made, refreshed
    /// or dropped), so the disk tier rebuilds its view only then.
    pub generation: u64,
}

impl Pin {
    /// Whether it holds its blocks in RAM (else only in the disk tier).
    pub fn in_ram(&self) -> bool {
        !self.blocks.is_empty()
    }
}

impl PrefixCache {
    /// The share of the pool pins may cover (`--cache-pin-fraction`), in `[0, 1]`.
    pub fn set_pin_fraction(&mut self, fraction: f64) -> Result<(), CoreError> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(CoreError::InvalidInput(format!(
                "pin fraction must be between 0 and 1, not {fraction}"
            )));
        }
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let max = (self.pool.len() as f64 * fraction).floor() as usize;
        self.pins.max_pinned = max;
        self.enforce_pin_cap();
        self.debug_check();
        Ok(())
    }

    /// Pins, for each breakpoint of `request_id`, the full blocks its table holds up to
    /// the breakpoint, until `now + ttl_secs` (a pin already there is refreshed; it keeps
    /// the later expiry and the longer TTL). Breakpoints past the blocks the table holds
    /// pin nothing. Returns how many pins were created or refreshed.
    pub fn pin(
        &mut self,
        request_id: &str,
        specs: &[PinSpec],
        now: f64,
    ) -> Result<usize, CoreError> {
        let table = self
            .tables
            .get(request_id)
            .ok_or_else(|| CoreError::UnknownRequest(format!("{request_id:?}")))?;
        let mut wanted: Vec<(Vec<BlockId>, PinSpec)> = Vec::new();
        for spec in specs {
            let n = spec.end_token / self.block_size;
            if n == 0 || n > table.blocks.len() {
                continue;
            }
            wanted.push((table.blocks[..n].to_vec(), *spec));
        }
        let mut count = 0;
        for (blocks, spec) in wanted {
            let Some(hash) = self.pool.blocks[blocks[blocks.len() - 1].index()].hash else {
                continue;
            };
            let expires_at = now + f64::from(spec.ttl_secs);
            if let Some(pin) = self.pins.pins.get_mut(&hash) {
                pin.expires_at = pin.expires_at.max(expires_at);
                pin.ttl_secs = pin.ttl_secs.max(spec.ttl_secs);
                if !pin.in_ram() {
                    // Read back (from disk): RAM holds it again.
                    for &id in &blocks {
                        self.pool.pin(id);
                    }
                    pin.blocks = blocks;
                }
            } else {
                // A request holds only cached blocks (checked by the invariants).
                let hashes: Vec<BlockHash> = blocks
                    .iter()
                    .filter_map(|id| self.pool.blocks[id.index()].hash)
                    .collect();
                for &id in &blocks {
                    self.pool.pin(id);
                }
                let pin = Pin {
                    hashes,
                    blocks,
                    ttl_secs: spec.ttl_secs,
                    expires_at,
                };
                self.pins.pins.insert(hash, pin);
            }
            count += 1;
        }
        if count > 0 {
            self.pins.generation += 1;
        }
        self.enforce_pin_cap();
        self.debug_check();
        Ok(count)
    }

    /// Drops the pins expired at `now`; returns how many.
    pub fn expire_pins(&mut self, now: f64) -> usize {
        let expired: Vec<BlockHash> = self
            .pins
            .pins
            .iter()
            .filter(|(_, pin)| pin.expires_at <= now)
            .map(|(&hash, _)| hash)
            .collect();
        for hash in &expired {
            self.pins.drop_pin(&mut self.pool, hash);
        }
        self.debug_check();
        expired.len()
    }

    /// The live pins that hold their blocks in RAM, earliest expiry first.
    pub fn pins(&self) -> Vec<PinInfo> {
        let mut out: Vec<PinInfo> = self
            .pins
            .pins
            .iter()
            .filter(|(_, pin)| pin.in_ram())
            .map(|(&hash, pin)| PinInfo {
                hash,
                tokens: pin.blocks.len() * self.block_size,
                ttl_secs: pin.ttl_secs,
                expires_at: pin.expires_at,
            })
            .collect();
        out.sort_by(|a, b| {
            a.expires_at
                .total_cmp(&b.expires_at)
                .then(a.hash.cmp(&b.hash))
        });
        out
    }

    /// Pool blocks covered by at least one pin.
    pub fn num_pinned_blocks(&self) -> usize {
        self.pool.num_pinned
    }

    /// Every block a live pin covers, in RAM or not (what the disk tier keeps), with the
    /// latest expiry of the pins covering it, in the order the disk tier lets them go:
    /// earliest expiry first and, within one expiry, the chain's last block first (what
    /// stays is still a reachable prefix).
    pub fn pinned_blocks(&self) -> Vec<(BlockHash, f64)> {
        let mut latest: HashMap<BlockHash, (f64, usize)> = HashMap::new();
        for pin in self.pins.pins.values() {
            for (depth, &hash) in pin.hashes.iter().enumerate() {
                let entry = latest.entry(hash).or_insert((pin.expires_at, depth));
                entry.0 = entry.0.max(pin.expires_at);
            }
        }
        let mut out: Vec<(BlockHash, f64, usize)> = latest
            .into_iter()
            .map(|(hash, (expires_at, depth))| (hash, expires_at, depth))
            .collect();
        out.sort_by(|a, b| a.1.total_cmp(&b.1).then(b.2.cmp(&a.2)).then(a.0.cmp(&b.0)));
        out.into_iter().map(|(hash, at, _)| (hash, at)).collect()
    }

    /// Changes whenever what [`Self::pinned_blocks`] lists may change.
    pub fn pin_generation(&self) -> u64 {
        self.pins.generation
    }

    /// Pins dropped before their expiry to make room.
    pub fn dropped_pins(&self) -> u64 {
        self.pins.dropped
    }

    /// Drops every pin (before evicting everything free).
    pub(super) fn drop_all_pins(&mut self) {
        let all: Vec<BlockHash> = self.pins.pins.keys().copied().collect();
        for hash in &all {
            self.pins.drop_pin(&mut self.pool, hash);
        }
    }

    fn enforce_pin_cap(&mut self) {
        while self.pool.num_pinned > self.pins.max_pinned && self.pins.drop_earliest(&mut self.pool)
        {
        }
    }
}

impl PinTable {
    /// A block for `hash`: an unpinned free one if any, else one freed by dropping the
    /// pins that expire first. `None` when every block is in use.
    pub(super) fn allocate(&mut self, pool: &mut BlockPool, hash: BlockHash) -> Option<BlockId> {
        loop {
            if let Some(id) = pool.allocate(hash) {
                return Some(id);
            }
            if pool.pinned_free.len == 0 || !self.drop_earliest(pool) {
                return None;
            }
        }
    }

    /// RAM lets go of the pin that expires first among those it holds (its blocks go
    /// to the ordinary free list); the pin keeps holding in the disk tier. `false` when
    /// RAM holds none.
    fn drop_earliest(&mut self, pool: &mut BlockPool) -> bool {
        let first = self
            .pins
            .iter_mut()
            .filter(|(_, pin)| pin.in_ram())
            .min_by(|a, b| a.1.expires_at.total_cmp(&b.1.expires_at).then(a.0.cmp(b.0)));
        let Some((_, pin)) = first else {
            return false;
        };
        unpin_blocks(pool, &std::mem::take(&mut pin.blocks));
        self.dropped += 1;
        true
    }

    fn drop_pin(&mut self, pool: &mut BlockPool, hash: &BlockHash) {
        if let Some(pin) = self.pins.remove(hash) {
            unpin_blocks(pool, &pin.blocks);
            self.generation += 1;
        }
    }
}

fn unpin_blocks(pool: &mut BlockPool, blocks: &[BlockId]) {
    // Last block first, as `release` does: a chain's tail goes before its head.
    for &id in blocks.iter().rev() {
        pool.unpin(id);
    }
}
