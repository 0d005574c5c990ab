//! `PrefixCache`: which blocks of prompt K/V are cached; Python keeps the tensors per
//! block id. One call per request (`admit`, `release`) or per step (`append`).
//!
//! The core sits behind a `Mutex` in a frozen class: hashing a long prompt releases
//! the GIL, and another thread calling in meanwhile (a token-count preview) waits for
//! the lock instead of failing to borrow.
use std::sync::Mutex;

use compat_core::prefix_cache::{
    image_hash as core_image_hash, Admission as CoreAdmission, BlockId, CacheStats, HashKind,
    MediaSpan, NewBlock as CoreNewBlock, PinSpec, PrefixCache as CorePrefixCache,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::error::PyCoreError;

/// Calls with at least this many tokens release the GIL while they hash (~2 µs of
/// work per 1k tokens; below this, handing the GIL over costs more than it frees).
const DETACH_MIN_TOKENS: usize = 4096;

/// Prefix-cache bookkeeping over `num_blocks` blocks of `block_size` tokens: chained
/// block hashes, refcounts, an LRU of free blocks, lazy eviction.
#[pyclass(frozen, module = "compat_serve._native")]
#[derive(Debug)]
pub struct PrefixCache {
    inner: Mutex<CorePrefixCache>,
}

/// What `admit` found: the first `cached_tokens` prompt tokens are served by the K/V of
/// `block_ids`, in order, `block_size` tokens each.
#[pyclass(frozen, get_all, module = "compat_serve._native")]
#[derive(Debug)]
pub struct Admission {
    cached_tokens: usize,
    block_ids: Vec<u32>,
}

/// A block `append` filled: the request's tokens `[start_token, start_token +
/// block_size)`, block number `index` of its table. Store its K/V under `block_id` if
/// `is_new`; otherwise the same content is cached there already.
#[pyclass(frozen, get_all, module = "compat_serve._native")]
#[derive(Debug)]
pub struct NewBlock {
    block_id: u32,
    index: usize,
    start_token: usize,
    is_new: bool,
}

/// Counters and gauges of a `PrefixCache`.
#[pyclass(frozen, get_all, module = "compat_serve._native")]
#[derive(Debug)]
pub struct PrefixCacheStats {
    block_size: usize,
    num_blocks: usize,
    /// Blocks holding cached K/V, in use or free.
    cached_blocks: usize,
    /// Blocks some request holds.
    in_use_blocks: usize,
    /// Blocks nobody holds (cached or empty).
    free_blocks: usize,
    /// Open request tables.
    num_requests: usize,
    /// Prompt tokens passed to `admit`, and how many of them hit.
    query_tokens: u64,
    hit_tokens: u64,
    /// Blocks `append` stored, found already cached, or could not cache (all in use).
    stored_blocks: u64,
    deduplicated_blocks: u64,
    uncached_blocks: u64,
    /// Cached blocks whose content was dropped (reallocation or `clear`).
    evictions: u64,
}

impl From<CoreAdmission> for Admission {
    fn from(a: CoreAdmission) -> Self {
        Self {
            cached_tokens: a.cached_tokens,
            block_ids: a.block_ids.into_iter().map(BlockId::get).collect(),
        }
    }
}

impl From<CoreNewBlock> for NewBlock {
    fn from(b: CoreNewBlock) -> Self {
        Self {
            block_id: b.block_id.get(),
            index: b.index,
            start_token: b.start_token,
            is_new: b.is_new,
        }
    }
}

impl From<CacheStats> for PrefixCacheStats {
    fn from(s: CacheStats) -> Self {
        Self {
            block_size: s.block_size,
            num_blocks: s.num_blocks,
            cached_blocks: s.cached_blocks,
            in_use_blocks: s.in_use_blocks,
            free_blocks: s.free_blocks,
            num_requests: s.num_requests,
            query_tokens: s.query_tokens,
            hit_tokens: s.hit_tokens,
            stored_blocks: s.stored_blocks,
            deduplicated_blocks: s.deduplicated_blocks,
            uncached_blocks: s.uncached_blocks,
            evictions: s.evictions,
        }
    }
}

impl PrefixCache {
    /// Runs `f` on the core under the lock, without the GIL when `tokens` is long.
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        tokens: usize,
        f: impl FnOnce(&mut CorePrefixCache) -> T + Send,
    ) -> PyResult<T> {
        let run = || self.inner.lock().map(|mut cache| f(&mut cache)).ok();
        let out = if tokens >= DETACH_MIN_TOKENS {
            py.detach(run)
        } else {
            run()
        };
        out.ok_or_else(|| PyRuntimeError::new_err("the prefix cache is unusable after a panic"))
    }
}

/// A live pin as Python gets it: `(hash of the last block, tokens, ttl_secs, expires_at)`.
type PyPin<'py> = (Bound<'py, PyBytes>, usize, u32, f64);

/// An image in a prompt as Python passes it: `(start, length, 16-byte hash)`.
type PyMedia = (usize, usize, Vec<u8>);

fn media_spans(images: Option<Vec<PyMedia>>) -> PyResult<Vec<MediaSpan>> {
    images
        .unwrap_or_default()
        .into_iter()
        .map(|(start, len, hash)| {
            let hash: [u8; 16] = hash.as_slice().try_into().map_err(|_| {
                PyValueError::new_err(format!("an image hash is 16 bytes, got {}", hash.len()))
            })?;
            Ok(MediaSpan { start, len, hash })
        })
        .collect()
}

/// xxh3-128 (the block hasher's seed) of an image's bytes: 16 bytes, big-endian.
#[pyfunction]
pub fn image_hash<'py>(py: Python<'py>, data: &[u8]) -> Bound<'py, PyBytes> {
    let digest = py.detach(|| core_image_hash(data));
    PyBytes::new(py, &digest)
}

// pyo3 extracts a list of ints into an owned `Vec`, never into a slice.
#[allow(clippy::needless_pass_by_value)]
#[pymethods]
impl PrefixCache {
    /// `hash_kind`: `"xxh3"` (xxh3-128, fixed seed) or `"sha256"`.
    #[new]
    #[pyo3(signature = (block_size, num_blocks, hash_kind = "xxh3"))]
    fn new(block_size: usize, num_blocks: usize, hash_kind: &str) -> PyResult<Self> {
        let kind: HashKind = hash_kind.parse().map_err(PyCoreError)?;
        let inner = CorePrefixCache::new(block_size, num_blocks, kind).map_err(PyCoreError)?;
        Ok(Self {
            inner: Mutex::new(inner),
        })
    }

    #[getter]
    fn block_size(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, 0, |c| c.block_size())
    }

    #[getter]
    fn num_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, 0, |c| c.num_blocks())
    }

    #[getter]
    fn hash_kind(&self, py: Python<'_>) -> PyResult<&'static str> {
        self.with(py, 0, |c| c.hash_kind().as_str())
    }

    /// Prompt tokens `admit` would serve from cache now (capped the same way);
    /// acquires nothing.
    #[pyo3(signature = (tokens, extra = None, images = None))]
    fn lookup(
        &self,
        py: Python<'_>,
        tokens: Vec<u32>,
        extra: Option<&[u8]>,
        images: Option<Vec<PyMedia>>,
    ) -> PyResult<usize> {
        let extra = extra.unwrap_or_default();
        let media = media_spans(images)?;
        Ok(self
            .with(py, tokens.len(), |c| c.media_lookup(&tokens, extra, &media))?
            .map_err(PyCoreError)?)
    }

    /// Opens request `id`'s table with the longest cached prefix of `tokens` (capped to
    /// leave at least one token to compute) and holds its blocks. `extra` (image
    /// hashes, a per-key cache salt) separates chains. `images`: `(start, length,
    /// hash)` of each image's placeholder tokens, keys of every block they overlap.
    #[pyo3(signature = (id, tokens, extra = None, images = None))]
    fn admit(
        &self,
        py: Python<'_>,
        id: &str,
        tokens: Vec<u32>,
        extra: Option<&[u8]>,
        images: Option<Vec<PyMedia>>,
    ) -> PyResult<Admission> {
        let extra = extra.unwrap_or_default();
        let media = media_spans(images)?;
        let admission = self
            .with(py, tokens.len(), |c| {
                c.admit_media(id, &tokens, extra, &media)
            })?
            .map_err(PyCoreError)?;
        Ok(admission.into())
    }

    /// Records request `id`'s next computed tokens (after those admitted or appended
    /// before) and returns each block they fill. Drain `take_evicted()` before storing
    /// the new blocks: one may reuse an id this call evicted.
    fn append(&self, py: Python<'_>, id: &str, tokens: Vec<u32>) -> PyResult<Vec<NewBlock>> {
        let filled = self
            .with(py, tokens.len(), |c| c.append(id, &tokens))?
            .map_err(PyCoreError)?;
        Ok(filled.into_iter().map(NewBlock::from).collect())
    }

    /// Closes request `id`'s table; its blocks stay cached until evicted. `False` if
    /// no such table is open.
    fn release(&self, py: Python<'_>, id: &str) -> PyResult<bool> {
        self.with(py, 0, |c| c.release(id))
    }

    /// Block ids whose cached content was evicted since the last call, oldest first:
    /// drop their K/V.
    fn take_evicted(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        self.with(py, 0, |c| {
            c.take_evicted().into_iter().map(BlockId::get).collect()
        })
    }

    /// Evicts every cached block no request holds (listed by `take_evicted`).
    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, 0, CorePrefixCache::clear)
    }

    /// Tokens request `id` has (admitted from cache plus appended), `None` if its
    /// table is not open.
    fn num_tokens(&self, py: Python<'_>, id: &str) -> PyResult<Option<usize>> {
        self.with(py, 0, |c| c.num_tokens(id))
    }

    fn stats(&self, py: Python<'_>) -> PyResult<PrefixCacheStats> {
        Ok(self.with(py, 0, |c| c.stats())?.into())
    }

    /// The chained hash of every full block of `tokens` (16 bytes for xxh3, 32 for
    /// sha256), as `admit` computes them.
    #[pyo3(signature = (tokens, extra = None, images = None))]
    fn block_hashes<'py>(
        &self,
        py: Python<'py>,
        tokens: Vec<u32>,
        extra: Option<&[u8]>,
        images: Option<Vec<PyMedia>>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let extra = extra.unwrap_or_default();
        let media = media_spans(images)?;
        let (kind, hashes) = self.with(py, tokens.len(), |c| {
            (c.hash_kind(), c.media_block_hashes(&tokens, extra, &media))
        })?;
        let hashes = hashes.map_err(PyCoreError)?;
        Ok(hashes
            .iter()
            .map(|h| PyBytes::new(py, h.digest(kind)))
            .collect())
    }

    /// The share of the pool `cache_control` pins may cover (`--cache-pin-fraction`):
    /// past it, the pins that expire first are dropped.
    fn set_pin_fraction(&self, py: Python<'_>, fraction: f64) -> PyResult<()> {
        Ok(self
            .with(py, 0, |c| c.set_pin_fraction(fraction))?
            .map_err(PyCoreError)?)
    }

    /// Pins, for each `(end_token, ttl_secs)` breakpoint, the full blocks request `id`
    /// holds up to `end_token` until `now + ttl_secs` (refreshing a pin already there).
    /// Returns how many pins were created or refreshed.
    fn pin(&self, py: Python<'_>, id: &str, pins: Vec<(usize, u32)>, now: f64) -> PyResult<usize> {
        let specs: Vec<PinSpec> = pins
            .into_iter()
            .map(|(end_token, ttl_secs)| PinSpec {
                end_token,
                ttl_secs,
            })
            .collect();
        Ok(self
            .with(py, 0, |c| c.pin(id, &specs, now))?
            .map_err(PyCoreError)?)
    }

    /// Drops the pins expired at `now`; returns how many.
    fn expire_pins(&self, py: Python<'_>, now: f64) -> PyResult<usize> {
        self.with(py, 0, |c| c.expire_pins(now))
    }

    /// The live pins RAM holds, earliest expiry first: `(hash of the last block, tokens,
    /// ttl_secs, expires_at)`.
    fn pins<'py>(&self, py: Python<'py>) -> PyResult<Vec<PyPin<'py>>> {
        let (kind, pins) = self.with(py, 0, |c| (c.hash_kind(), c.pins()))?;
        Ok(pins
            .into_iter()
            .map(|p| {
                (
                    PyBytes::new(py, p.hash.digest(kind)),
                    p.tokens,
                    p.ttl_secs,
                    p.expires_at,
                )
            })
            .collect())
    }

    /// Every block a live pin covers, held in RAM or not (what the disk tier keeps):
    /// `(chained hash, latest expiry of the pins covering it)`, earliest expiry first and,
    /// within one expiry, the chain's last block first.
    fn pinned_blocks<'py>(&self, py: Python<'py>) -> PyResult<Vec<(Bound<'py, PyBytes>, f64)>> {
        let (kind, blocks) = self.with(py, 0, |c| (c.hash_kind(), c.pinned_blocks()))?;
        Ok(blocks
            .into_iter()
            .map(|(hash, expires_at)| (PyBytes::new(py, hash.digest(kind)), expires_at))
            .collect())
    }

    /// Changes whenever what `pinned_blocks` lists may change (a pin made, refreshed or
    /// dropped).
    fn pin_generation(&self, py: Python<'_>) -> PyResult<u64> {
        self.with(py, 0, |c| c.pin_generation())
    }

    /// Pool blocks covered by at least one pin, and pins RAM let go of before expiry to
    /// make room.
    fn pin_counts(&self, py: Python<'_>) -> PyResult<(usize, u64)> {
        self.with(py, 0, |c| (c.num_pinned_blocks(), c.dropped_pins()))
    }

    /// Raises `SchedulerError` if an internal invariant is broken (for tests).
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        Ok(self
            .with(py, 0, |c| c.check_invariants())?
            .map_err(PyCoreError)?)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let s = self.with(py, 0, |c| c.stats())?;
        Ok(format!(
            "<PrefixCache block_size={} blocks={} cached={} in_use={} requests={}>",
            s.block_size, s.num_blocks, s.cached_blocks, s.in_use_blocks, s.num_requests
        ))
    }
}

#[pymethods]
impl Admission {
    fn __repr__(&self) -> String {
        format!(
            "<Admission cached_tokens={} blocks={}>",
            self.cached_tokens,
            self.block_ids.len()
        )
    }
}

#[pymethods]
impl NewBlock {
    fn __repr__(&self) -> String {
        format!(
            "<NewBlock block_id={} index={} start_token={} is_new={}>",
            self.block_id,
            self.index,
            self.start_token,
            if self.is_new { "True" } else { "False" }
        )
    }
}

#[pymethods]
impl PrefixCacheStats {
    /// The share of admitted prompt tokens served from cache (0.0 before any).
    #[getter]
    fn hit_rate(&self) -> f64 {
        if self.query_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.query_tokens as f64
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "<PrefixCacheStats cached={}/{} in_use={} hit_tokens={}/{} evictions={}>",
            self.cached_blocks,
            self.num_blocks,
            self.in_use_blocks,
            self.hit_tokens,
            self.query_tokens,
            self.evictions
        )
    }
}
