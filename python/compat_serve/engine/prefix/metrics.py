"""The prefix cache's counters, for /v1/status and /metrics."""

from __future__ import annotations

from compat_serve.engine.prefix.storing import PrefixStoring


def prefix_metrics(prefix: PrefixStoring) -> dict[str, float]:
    """The prefix cache's counters (RAM and disk tiers) for /v1/status and /metrics."""
    stats = prefix.cache.stats()
    query = stats.query_tokens
    hits = stats.hit_tokens + prefix.promoted_hit_tokens + prefix.partial_hit_tokens
    disk = prefix.disk
    points_bytes = prefix.points.bytes_in_use if prefix.points is not None else 0
    return {
        "blocks": stats.cached_blocks,
        "bytes": prefix.store.bytes_in_use + points_bytes,
        "capacity_blocks": stats.num_blocks,
        "query_tokens": query,
        "hit_tokens": hits,
        "hit_ratio": hits / query if query else 0.0,
        "evictions": stats.evictions,
        "faults": prefix.faults,
        "disk_files": len(disk) if disk is not None else 0,
        "disk_bytes": disk.bytes_in_use if disk is not None else 0,
        "disk_capacity_bytes": disk.capacity_bytes if disk is not None else 0,
        "disk_hit_tokens": disk.hit_tokens if disk is not None else 0,
        "disk_read_bytes": disk.read_bytes if disk is not None else 0,
        "disk_read_seconds": disk.read_seconds if disk is not None else 0.0,
        "disk_writes": disk.writes if disk is not None else 0,
        "disk_write_drops": disk.write_drops if disk is not None else 0,
        "disk_faults": disk.faults if disk is not None else 0,
        "disk_writing": float(disk.writing) if disk is not None else 0.0,
    }
