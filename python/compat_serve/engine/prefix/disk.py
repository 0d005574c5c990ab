"""The disk tier of the prefix cache (`--cache-dir`): blocks and tails that survive
eviction from RAM and restarts.

- **Write-through, off the engine thread.** Every block (and tail) the RAM tier stores is
  queued here and written by one background thread, so a block evicted from RAM, or lost
  with the process, is already on disk. Until written, a queued entry is served from the
  queue itself. A full queue drops the write (counted); a full disk (or any write error)
  stops writing, with one warning.
- **Files.** `DIR/<model fingerprint>/<parent id>_<key>.kv`, one per block, tail or
  state snapshot (hybrid models; parent id `snapshots`, key `s` + the block hash). The
  fingerprint covers the model, its dtype, the block size, the hash function and the
  format version, so files of another model are never even listed. `key` is the block's
  chained hash (hex) or, for a tail, a digest of its parent and tokens; `parent id` a
  digest of the parent block's chained hash (or of the root key), which gives the
  children of a block without opening files.
- **Format** (little-endian): magic, header length (u32), JSON header (key, parent,
  tokens, per layer dtype and shapes or null; for a snapshot, per layer the cache class,
  meta state and state tree), the raw array bytes, and a CRC-32 of everything before
  it. A file is written under a temporary name and renamed into place, so a kill -9
  mid-write leaves only a temporary file (deleted at the next start); a truncated or
  corrupted file fails its length or checksum check, is logged, deleted and never
  served.
- **Index.** Rebuilt at startup from the file names alone (one directory scan), least
  recently modified first; a hit touches its file. Past the size cap, the least recently
  used files are deleted, pinned blocks (`cache_control` breakpoints, asked of the RAM
  side's pin table) after the others (disk_evict.py).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import importlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from compat_serve.engine.kv_quant import components, nbytes
from compat_serve.engine.prefix.disk_evict import next_victim
from compat_serve.engine.prefix.pins import DEFAULT_PIN_FRACTION
from compat_serve.engine.prefix.store import BlockKV

if TYPE_CHECKING:
    from compat_serve.engine.config import EngineConfig
    from compat_serve.models.types import LoadedModel

log = logging.getLogger("compat_serve.engine")

FORMAT_VERSION = 1
MAGIC = b"CSKVBLK1"
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
# Default cap: this share of the free space on the cache directory's disk at start.
DEFAULT_DISK_SHARE = 0.25
# Queued writes hold their tensors in RAM: past this many bytes a write is dropped.
MAX_PENDING_BYTES = 512 * 2**20
# Children of one parent whose headers a partial match reads at most (newest first).
MAX_CHILDREN_SCANNED = 8

_DTYPES: dict[str, mx.Dtype] = {
    str(d): d for d in (mx.float32, mx.float16, mx.bfloat16, mx.int8, mx.uint8, mx.uint32, mx.int32)
}


def parent_id(parent_key: bytes) -> str:
    return hashlib.blake2b(parent_key, digest_size=16).hexdigest()


def tail_key(parent_key: bytes, tokens: Sequence[int]) -> str:
    digest = hashlib.blake2b(parent_key, digest_size=15)
    digest.update(np.asarray(tokens, dtype=np.uint32).tobytes())
    return "t" + digest.hexdigest()


def point_key(parent_key: bytes, tokens: Sequence[int]) -> str:
    """A state point's entry (points.py): its parent key and tokens, as for a tail."""
    return "p" + tail_key(parent_key, tokens)[1:]


def model_fingerprint(*parts: object) -> str:
    text = json.dumps([FORMAT_VERSION, *[str(p) for p in parts]])
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def open_disk_tier(
    config: EngineConfig, loaded: LoadedModel, *kv_shape: object
) -> DiskStore | None:
    """The disk tier of `loaded`'s prefix cache under `config.cache_dir` (None without
    one), in the directory of its fingerprint: the model, its weights (a rank's own shard
    in distributed mode), `kv_shape` (what else decides the K/V's layout), the block size,
    the hash and a quantized KV format. Another KV format's files are never even listed:
    a miss, not an error."""
    if config.cache_dir is None:
        return None
    fingerprint = model_fingerprint(
        loaded.source,
        loaded.name,
        loaded.dtype,
        loaded.model_type,
        weights_digest(loaded.model),
        *kv_shape,
        config.block_size,
        config.cache_hash,
        *([config.kv_format.tag] if config.kv_format.quantized else []),
    )
    return DiskStore(
        config.cache_dir, fingerprint, config.cache_disk_bytes, config.cache_pin_fraction
    )


def weights_digest(model: Any) -> str:
    """A digest of a sample of the weights (the first 4096 values of a few tensors), so
    two models with the same name and shapes but different weights never share files."""
    flat: list[tuple[str, mx.array]] = list(tree_flatten(model.parameters()))  # type: ignore[arg-type]
    digest = hashlib.blake2b(digest_size=12)
    for name, array in [*flat[:4], *flat[-4:]]:
        sample = array.reshape(-1)[:4096]
        digest.update(name.encode())
        digest.update(str(array.shape).encode())
        digest.update(raw_bytes(mx.contiguous(sample.astype(mx.float32))))
    return digest.hexdigest()


def raw_bytes(array: mx.array) -> bytes:
    """The array's bytes as stored (any dtype, bfloat16 included; evaluated if not yet)."""
    view: Any = array
    return bytes(memoryview(view))


def open_temp(path: Path) -> BinaryIO:
    """Where a file is written before its rename (tests point it at /dev/full)."""
    return open(path, "wb")


@dataclass(frozen=True)
class DiskEntry:
    key: str
    parent: str  # parent_id of the parent key
    tokens: tuple[int, ...]
    kv: BlockKV
    # A hybrid model's state snapshot (`PrefixStore` layout), for snapshot entries.
    snapshot: list[Any] | None = None


@dataclass
class _Indexed:
    parent: str
    size: int


class DiskFault(RuntimeError):
    """A file that fails its checks; it is deleted and never served."""


def encode(
    key: str, parent: str, tokens: Sequence[int], kv: BlockKV, snapshot: list[Any] | None = None
) -> list[bytes]:
    layers: list[list[object] | dict[str, object] | None] = []
    arrays: list[mx.array] = []
    for piece in kv:
        if piece is None:
            layers.append(None)
            continue
        k, v = piece
        if isinstance(k, tuple):  # quantized (kv_quant.py): three arrays each
            layers.append(
                {
                    "k": [[str(a.dtype), list(a.shape)] for a in k],
                    "v": [[str(a.dtype), list(a.shape)] for a in v],
                }
            )
            arrays += [*k, *v]
            continue
        layers.append([str(k.dtype), list(k.shape), str(v.dtype), list(v.shape)])
        arrays += [k, v]
    fields: dict[str, object] = {"key": key, "parent": parent, "tokens": list(tokens)}
    fields["layers"] = layers
    if snapshot is not None:
        fields["snapshot"] = [
            None
            if saved is None
            else {
                "type": f"{saved[0].__module__}:{saved[0].__qualname__}",
                "meta": saved[2],
                "tree": _skeleton(saved[1], arrays),
            }
            for saved in snapshot
        ]
    header = json.dumps(fields).encode()
    parts = [MAGIC, struct.pack("<I", len(header)), header, *[raw_bytes(a) for a in arrays]]
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return [*parts, struct.pack("<I", crc)]


def _skeleton(value: Any, arrays: list[mx.array]) -> Any:
    """A state tree as JSON, its arrays replaced by their dtype and shape (appended to
    `arrays`, whose bytes follow in the file in that order)."""
    if isinstance(value, mx.array):
        arrays.append(value)
        return {"a": [str(value.dtype), list(value.shape)]}
    if isinstance(value, (list, tuple)):
        return {"l" if isinstance(value, list) else "t": [_skeleton(v, arrays) for v in value]}
    if value is None or isinstance(value, (int, float, str, bool)):
        return {"v": value}
    raise TypeError(f"cannot persist a {type(value).__name__} in a state snapshot")


class _Payload:
    def __init__(self, data: bytes | bytearray, pos: int) -> None:
        self.raw = np.frombuffer(data, dtype=np.uint8)
        self.pos = pos

    def array(self, dtype_name: str, shape: list[int]) -> mx.array:
        dtype = _DTYPES.get(dtype_name)
        if dtype is None:
            raise DiskFault(f"unknown dtype {dtype_name}")
        size = int(np.prod(shape)) * dtype.size
        chunk = self.raw[self.pos : self.pos + size]
        self.pos += size
        if chunk.size != size:
            raise DiskFault("payload shorter than its header says")
        return mx.array(chunk).view(dtype).reshape(shape)

    def tree(self, skeleton: Any) -> Any:
        if "a" in skeleton:
            return self.array(*skeleton["a"])
        if "l" in skeleton:
            return [self.tree(s) for s in skeleton["l"]]
        if "t" in skeleton:
            return tuple(self.tree(s) for s in skeleton["t"])
        return skeleton["v"]


def _layer_type(name: str) -> type:
    module, _, qualname = name.partition(":")
    value: Any = importlib.import_module(module)
    for part in qualname.split("."):
        value = getattr(value, part)
    if not isinstance(value, type):
        raise DiskFault(f"{name} is not a cache class")
    return value


def _header(data: bytes | bytearray | memoryview) -> tuple[dict[str, object], int]:
    if len(data) < len(MAGIC) + 4 or bytes(data[: len(MAGIC)]) != MAGIC:
        raise DiskFault("not a block file")
    (length,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    if start + length > len(data):
        raise DiskFault("truncated header")
    try:
        header = json.loads(bytes(data[start : start + length]))
    except ValueError as exc:
        raise DiskFault(f"unreadable header ({exc})") from None
    if not isinstance(header, dict):
        raise DiskFault("unreadable header")
    return header, start + length


def decode(data: bytes | bytearray) -> DiskEntry:
    if len(data) < len(MAGIC) + 8:
        raise DiskFault("truncated")
    (crc,) = struct.unpack_from("<I", data, len(data) - 4)
    if zlib.crc32(memoryview(data)[:-4]) != crc:
        raise DiskFault("checksum mismatch (truncated or corrupted)")
    header, pos = _header(data)
    payload = _Payload(data, pos)
    kv: BlockKV = []
    for layer in header["layers"]:  # type: ignore[attr-defined]
        if layer is None:
            kv.append(None)
            continue
        if isinstance(layer, dict):  # quantized K/V: (packed, scales, biases) each
            k = tuple(payload.array(*spec) for spec in layer["k"])
            v = tuple(payload.array(*spec) for spec in layer["v"])
            if len(k) != 3 or len(v) != 3:
                raise DiskFault("a quantized layer needs three arrays for K and for V")
            kv.append((k, v))
            continue
        kv.append((payload.array(layer[0], layer[1]), payload.array(layer[2], layer[3])))
    snapshot: list[Any] | None = None
    if "snapshot" in header:
        snapshot = [
            None
            if saved is None
            else (_layer_type(saved["type"]), payload.tree(saved["tree"]), saved["meta"])
            for saved in header["snapshot"]  # type: ignore[attr-defined]
        ]
    if payload.pos != len(data) - 4:
        raise DiskFault("payload length does not match its header")
    mx.eval([a for p in kv if p is not None for part in p for a in components(part)])
    tokens: Any = header["tokens"]
    return DiskEntry(str(header["key"]), str(header["parent"]), tuple(tokens), kv, snapshot)


class DiskStore:
    """The files of one model fingerprint under `root`, with a background writer."""

    def __init__(
        self,
        root: Path | str,
        fingerprint: str,
        capacity_bytes: int | None,
        pin_fraction: float = DEFAULT_PIN_FRACTION,
    ) -> None:
        self.dir = Path(root) / fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        if capacity_bytes is None:
            capacity_bytes = int(_free_bytes(self.dir) * DEFAULT_DISK_SHARE)
        self.capacity_bytes = capacity_bytes
        # Pinned keys and their expiry, asked of the RAM side's pin table when files must
        # go (the prefix cache sets it; called on the writer thread).
        self.pinned: Callable[[], Mapping[str, float]] | None = None
        self.pin_fraction = pin_fraction
        self._lock = threading.Lock()
        self._index: collections.OrderedDict[str, _Indexed] = collections.OrderedDict()
        self._children: dict[str, dict[str, None]] = {}
        self._tokens: dict[str, tuple[int, ...]] = {}  # headers read so far
        self._pending: dict[str, DiskEntry] = {}
        self._pending_bytes = 0
        self.bytes_in_use = 0
        self.writes = 0
        self.write_drops = 0
        self.faults = 0
        self.hit_tokens = 0
        self.read_bytes = 0
        self.read_seconds = 0.0
        self.writing = True
        started = time.perf_counter()
        self._rebuild()
        self.rebuild_seconds = time.perf_counter() - started
        log.info(
            "prefix cache disk tier: %s, %d files (%.0f MiB) indexed in %.3f s, cap %.0f MiB",
            self.dir,
            len(self._index),
            self.bytes_in_use / 2**20,
            self.rebuild_seconds,
            self.capacity_bytes / 2**20,
        )
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._write_loop, name="compat-disk", daemon=True)
        self._thread.start()

    # ---- index --------------------------------------------------------------------------

    def _rebuild(self) -> None:
        found: list[tuple[float, str, str, int]] = []
        with os.scandir(self.dir) as entries:
            for entry in entries:
                name = entry.name
                if name.endswith(TMP_SUFFIX):  # a write cut short (kill -9): never valid
                    _unlink(Path(entry.path))
                    continue
                if not name.endswith(SUFFIX) or "_" not in name:
                    continue
                parent, key = name[: -len(SUFFIX)].split("_", 1)
                try:
                    st = entry.stat()
                except OSError:
                    continue
                found.append((st.st_mtime, key, parent, st.st_size))
        found.sort()
        for _, key, parent, size in found:
            self._add(key, parent, size)

    def _add(self, key: str, parent: str, size: int) -> None:
        if key in self._index:
            self._index.move_to_end(key)
            return
        self._index[key] = _Indexed(parent, size)
        self._children.setdefault(parent, {})[key] = None
        self.bytes_in_use += size

    def _remove(self, key: str) -> None:
        item = self._index.pop(key, None)
        if item is None:
            return
        self.bytes_in_use -= item.size
        self._tokens.pop(key, None)
        children = self._children.get(item.parent)
        if children is not None:
            children.pop(key, None)
            if not children:
                del self._children[item.parent]
        _unlink(self._path(key, item.parent))

    def _path(self, key: str, parent: str) -> Path:
        return self.dir / f"{parent}_{key}{SUFFIX}"

    def __len__(self) -> int:
        return len(self._index)

    def has(self, key: str) -> bool:
        with self._lock:
            return key in self._pending or key in self._index

    def children(self, parent: str) -> list[tuple[str, tuple[int, ...]]]:
        """(key, tokens) of the most recent entries under `parent`."""
        with self._lock:
            pending = [(k, e.tokens) for k, e in self._pending.items() if e.parent == parent]
            keys = list(self._children.get(parent, {}))[-MAX_CHILDREN_SCANNED:]
        out = list(pending)
        for key in reversed(keys):
            tokens = self._tokens.get(key)
            if tokens is None:
                tokens = self._read_tokens(key, parent)
            if tokens is not None:
                out.append((key, tokens))
        return out

    def _read_tokens(self, key: str, parent: str) -> tuple[int, ...] | None:
        try:
            with open(self._path(key, parent), "rb") as f:
                head = f.read(len(MAGIC) + 4)
                if len(head) == len(MAGIC) + 4:
                    head += f.read(struct.unpack_from("<I", head, len(MAGIC))[0])
            header, _ = _header(head)
            listed: Any = header["tokens"]
            tokens: tuple[int, ...] = tuple(listed)
        except (OSError, DiskFault, KeyError, TypeError) as exc:
            self._fault(key, exc)
            return None
        with self._lock:
            if key in self._index:
                self._tokens[key] = tokens
        return tokens

    # ---- reads (engine thread) -----------------------------------------------------------

    def load(self, key: str) -> DiskEntry | None:
        """The entry under `key`, or None (missing, or failing its checks: then deleted)."""
        with self._lock:
            pending = self._pending.get(key)
            item = self._index.get(key)
            if item is not None:
                self._index.move_to_end(key)
        if pending is not None:
            return pending
        if item is None:
            return None
        path = self._path(key, item.parent)
        started = time.perf_counter()
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:  # deleted past the cap meanwhile: a miss, not a fault
            with self._lock:
                self._remove(key)
            return None
        except OSError as exc:
            self._fault(key, exc)
            return None
        try:
            entry = decode(data)
            if entry.key != key or entry.parent != item.parent:
                raise DiskFault("file renamed or misplaced")
        except (DiskFault, KeyError, TypeError, ValueError, ImportError, AttributeError) as exc:
            self._fault(key, exc)
            return None
        self.read_seconds += time.perf_counter() - started
        self.read_bytes += len(data)
        with contextlib.suppress(OSError):
            os.utime(path)
        return entry

    def _fault(self, key: str, exc: BaseException) -> None:
        self.faults += 1
        log.warning("prefix cache disk: skipping %s (%s: %s)", key, type(exc).__name__, exc)
        with self._lock:
            self._remove(key)

    # ---- writes ---------------------------------------------------------------------------

    def put(
        self,
        key: str,
        parent: str,
        tokens: Sequence[int],
        kv: BlockKV,
        snapshot: list[Any] | None = None,
    ) -> None:
        """Queue an entry for writing (never blocks; dropped if the queue is full)."""
        if not self.writing:
            return
        size = _nbytes(kv)
        with self._lock:
            if key in self._index or key in self._pending:
                return
            if self._pending_bytes + size > MAX_PENDING_BYTES:
                self.write_drops += 1
                return
            self._pending[key] = DiskEntry(key, parent, tuple(tokens), kv, snapshot)
            self._pending_bytes += size
            self._idle.clear()
        self._queue.put(key)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is done (tests, shutdown)."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _write_loop(self) -> None:
        while True:
            key = self._queue.get()
            if key is None:
                return
            with self._lock:
                entry = self._pending.get(key)
            if entry is not None:
                self._write(entry)
            with self._lock:
                if entry is not None:
                    self._pending.pop(key, None)
                    self._pending_bytes -= _nbytes(entry.kv)
                if not self._pending:
                    self._idle.set()

    def _write(self, entry: DiskEntry) -> None:
        if not self.writing:
            return
        final = self._path(entry.key, entry.parent)
        temp = final.with_name(final.name + f".{os.getpid()}{TMP_SUFFIX}")
        try:
            parts = encode(entry.key, entry.parent, entry.tokens, entry.kv, entry.snapshot)
            size = sum(len(p) for p in parts)
            with open_temp(temp) as f:
                for part in parts:
                    f.write(part)
            os.replace(temp, final)
        except TypeError as exc:  # a state this format cannot hold: RAM only
            _unlink(temp)
            self.write_drops += 1
            log.warning("prefix cache disk: not writing %s (%s)", entry.key, exc)
            return
        except OSError as exc:
            _unlink(temp)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):
                self.writing = False
                log.warning("prefix cache disk: %s; disk writes stop (reads go on)", exc)
            else:
                self.write_drops += 1
                log.warning("prefix cache disk: write of %s failed (%s)", entry.key, exc)
            return
        # Only this thread adds bytes: no eviction needed now means none after. The pins
        # are asked for outside the lock (the engine thread reads under it).
        over = self.bytes_in_use + size > self.capacity_bytes
        pinned = self.pinned() if over and self.pinned is not None else {}
        with self._lock:
            self._add(entry.key, entry.parent, size)
            self._tokens[entry.key] = entry.tokens
            self.writes += 1
            pin_bytes = self.pin_fraction * self.capacity_bytes
            while self.bytes_in_use > self.capacity_bytes and len(self._index) > 1:
                self._remove(next_victim(self._index, pinned, pin_bytes))

    def clear(self) -> None:
        self.flush()
        with self._lock:
            for key in list(self._index):
                self._remove(key)


def _nbytes(kv: BlockKV) -> int:
    return sum(nbytes(p[0]) + nbytes(p[1]) for p in kv if p is not None)


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
