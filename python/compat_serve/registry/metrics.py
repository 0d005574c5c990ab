"""The hub's Prometheus series: loads, evictions, load time and resident bytes per model."""

from __future__ import annotations

import threading

from compat_serve.engine.metrics import (
    DURATION_BUCKETS,
    Counter,
    Histogram,
    escape_help,
    format_labels,
    format_value,
)

_RESIDENT_HELP = "Memory a resident model holds: weights, KV and prefix cache"


class HubMetrics:
    def __init__(self, model_ids: list[str]) -> None:
        self.loads = Counter(
            "compat_model_loads_total",
            "Models loaded (a load shared by requests counts once)",
            ["model"],
        )
        self.evictions = Counter(
            "compat_model_evictions_total",
            "Models unloaded, by reason: ttl, lru (to make room), request (an unload call)",
            ["model", "reason"],
        )
        self.load_seconds = Histogram(
            "compat_model_load_seconds",
            "Seconds from the start of a load to a running engine",
            DURATION_BUCKETS,
        )
        self._resident: dict[str, int] = {model_id: 0 for model_id in model_ids}
        self._lock = threading.Lock()
        for model_id in model_ids:
            self.loads.touch(model=model_id)

    def set_resident(self, model_id: str, size: int) -> None:
        with self._lock:
            self._resident[model_id] = size

    def render(self) -> str:
        name = "compat_model_resident_bytes"
        lines = [
            f"# HELP {name} {escape_help(_RESIDENT_HELP)}",
            f"# TYPE {name} gauge",
        ]
        with self._lock:
            resident = sorted(self._resident.items())
        for model_id, size in resident:
            lines.append(f"{name}{format_labels([('model', model_id)])} {format_value(size)}")
        return (
            "\n".join(
                [
                    *self.loads.render(),
                    *self.evictions.render(),
                    *self.load_seconds.render(),
                    *lines,
                ]
            )
            + "\n"
        )


def merge_expositions(parts: list[tuple[str, str]]) -> str:
    """Several engines' Prometheus texts as one: each family's HELP/TYPE once, every
    sample labelled with its model (`model="<id>"`, unless it has a `model` label of its
    own), the families in first-seen order."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for model_id, text in parts:
        family = ""
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line.split(" ", 3)[2]
                seen = headers.setdefault(family, [])
                samples.setdefault(family, [])
                if line[:6] not in (h[:6] for h in seen):
                    seen.append(line)
            elif line and not line.startswith("#"):
                samples.setdefault(family, []).append(_labelled(line, model_id))
    lines = []
    for family, rows in samples.items():
        lines += headers.get(family, [])
        lines += rows
    return "\n".join(lines) + "\n" if lines else ""


def _labelled(sample: str, model_id: str) -> str:
    name_and_labels, _, value = sample.rpartition(" ")
    label = format_labels([("model", model_id)])[1:-1]
    if "{" in name_and_labels:
        name, _, labels = name_and_labels.partition("{")
        if 'model="' in labels.split("}")[0]:
            return sample
        return f"{name}{{{label},{labels} {value}"
    return f"{name_and_labels}{{{label}}} {value}"
