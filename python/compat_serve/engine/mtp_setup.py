"""The MTP head `--speculative mtp` drafts with, found at start: the file `--mtp-head`
names (engine/mtp_head.py), else the one the checkpoint ships (engine/mtp_families.py)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from compat_serve.engine.mtp_families import load_family_head
from compat_serve.engine.mtp_head import MTP_FAMILIES, MTPHead, MTPHeadError, load_head
from compat_serve.engine.speculation import SpeculationConfig

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel


def head_for(loaded: LoadedModel, path: str | None) -> MTPHead:
    """The MTP head `--speculative mtp` drafts with: the file `--mtp-head` names, else the
    checkpoint's own (engine/mtp_families.py). A model without one fails here, at start,
    in one line."""
    if path:
        return load_head(path, loaded.model)
    own = load_family_head(loaded)
    if own is not None:
        return own
    raise MTPHeadError(
        f"--speculative mtp: {loaded.name} has no MTP weights (the families whose "
        f"checkpoints ship them: {MTP_FAMILIES}); give a trained head with --mtp-head FILE"
    )


def with_mtp_head(config: SpeculationConfig, loaded: LoadedModel) -> SpeculationConfig:
    """`config` with its MTP head built (from `--mtp-head`); unchanged unless the mode is
    `mtp`. Raises `MTPHeadError` (one line) when the model has no head."""
    if config.mode != "mtp" or config.mtp is not None:
        return config
    return dataclasses.replace(config, mtp=head_for(loaded, config.mtp_head))
