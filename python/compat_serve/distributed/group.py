"""Joining the group (`mx.distributed.init(strict=True)`) and checking that every rank was
started the same way, in the first collective."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np


class DistributedStartError(ValueError):
    """The group cannot start; the message is one line naming the cause."""


def backend_from_env(env: dict[str, str] | None = None) -> str:
    """Which backend the environment sets up: JACCL (`MLX_JACCL_COORDINATOR`, as
    `mlx.launch --backend jaccl` sets) or ring (`MLX_RANK` + `MLX_HOSTFILE`)."""
    env = dict(os.environ) if env is None else env
    if env.get("MLX_JACCL_COORDINATOR"):
        return "jaccl"
    rank, hostfile = env.get("MLX_RANK"), env.get("MLX_HOSTFILE")
    if not rank and not hostfile:
        raise DistributedStartError(
            "--distributed: no MLX group in the environment; start every rank with "
            "mlx.launch, or set MLX_RANK and MLX_HOSTFILE (ring) or MLX_JACCL_COORDINATOR "
            "(jaccl)"
        )
    if not rank or not hostfile:
        missing = "MLX_RANK" if not rank else "MLX_HOSTFILE"
        raise DistributedStartError(f"--distributed: {missing} is not set (the ring needs both)")
    if not os.path.isfile(hostfile):
        raise DistributedStartError(f"--distributed: MLX_HOSTFILE {hostfile} is not a file")
    return "ring"


def join_group() -> mx.distributed.Group:
    backend = backend_from_env()
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as exc:
        cause = str(exc).strip().splitlines()[0]
        raise DistributedStartError(
            f"--distributed: cannot join the {backend} group: {cause}"
        ) from None
    if group.size() < 2:
        raise DistributedStartError(f"--distributed: the {backend} group has only one rank")
    return group


def fingerprint(options: dict[str, Any], config_bytes: bytes, path: Path | None) -> bytes:
    """32 bytes that differ when ranks were started with other flags or another model
    (its config.json, and the names and sizes of its weight files)."""
    digest = hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode())
    digest.update(hashlib.sha256(config_bytes).digest())
    if path is not None:
        for weights in sorted(path.glob("*.safetensors")):
            digest.update(f"{weights.name}:{weights.stat().st_size};".encode())
    return digest.digest()


def agree(group: mx.distributed.Group, print_: bytes, problem: str | None) -> None:
    """The first collective: every rank shares whether it can start and its fingerprint.
    Raises DistributedStartError on every rank when any rank cannot start or differs
    from rank 0 (each rank names the cause it knows)."""
    row = np.zeros(33, dtype=np.int32)
    row[0] = 1 if problem else 0
    row[1:] = np.frombuffer(print_, dtype=np.uint8)
    rows = np.array(mx.distributed.all_gather(mx.array(row[None]), group=group, stream=mx.cpu))
    if problem:
        raise DistributedStartError(problem)
    failed = [rank for rank in range(group.size()) if rows[rank, 0]]
    if failed:
        raise DistributedStartError(
            f"--distributed: rank {failed[0]} cannot start (its log says why)"
        )
    differ = [rank for rank in range(group.size()) if (rows[rank, 1:] != rows[0, 1:]).any()]
    if differ:
        raise DistributedStartError(
            f"--distributed: rank {differ[0]} was started with a different model or flags "
            "than rank 0"
        )
