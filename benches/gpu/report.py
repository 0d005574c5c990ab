"""The run's time budget and its report, written as Markdown and JSON after every row, so a
run cut short (a time limit, a crash) still leaves its table behind."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class Budget:
    """Wall time for the whole run, shared out among sections by weight: each section gets
    its share of what is left when it starts, so time an early section does not use goes
    to the later ones. A watchdog ends the process `grace_s` past the end, after the last
    report write, so the device call returns with its files instead of timing out."""

    def __init__(self, total_s: float, weights: dict[str, float], grace_s: float = 30.0):
        self.started = time.monotonic()
        self.end = self.started + total_s
        self.weights = dict(weights)
        self.grace_s = grace_s
        self.section = ""
        self.section_end = self.end

    def left(self) -> float:
        return self.end - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def start(self, name: str) -> float:
        """Enter section `name`; returns the seconds it may use."""
        weight = self.weights.pop(name, 0.0)
        share = weight / (weight + sum(self.weights.values())) if weight else 0.0
        self.section = name
        self.section_end = time.monotonic() + max(self.left(), 0.0) * share
        return self.section_end - time.monotonic()

    def section_left(self) -> float:
        return min(self.section_end, self.end) - time.monotonic()

    def watchdog(self, on_expiry: Any) -> None:
        def watch() -> None:
            time.sleep(max(self.end - time.monotonic(), 0.0) + self.grace_s)
            on_expiry()
            os._exit(3)

        threading.Thread(target=watch, name="budget-watchdog", daemon=True).start()


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        lines = [f"### {self.title}", ""]
        lines.append("| " + " | ".join(self.columns) + " |")
        lines.append("|" + "---|" * len(self.columns))
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        lines += ["", *(f"- {note}" for note in self.notes)] if self.notes else []
        return "\n".join(lines) + "\n"


@dataclass
class Report:
    """Tables for people, records (every measured number) for the next session's JSON."""

    out: Path
    header: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, Table] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def table(self, key: str, title: str, columns: list[str]) -> Table:
        return self.tables.setdefault(key, Table(title, columns))

    def row(self, key: str, cells: list[Any], **record: Any) -> None:
        self.tables[key].rows.append([str(c) for c in cells])
        self.records.append({"table": key, **record})
        self.save()

    def note(self, key: str, text: str) -> None:
        self.tables[key].notes.append(text)
        self.save()

    def skip(self, what: str) -> None:
        print(f"skipped: {what}", flush=True)
        self.skipped.append(what)
        self.save()

    def markdown(self) -> str:
        lines = ["## GPU kit run", ""]
        lines += [f"- {key}: {value}" for key, value in self.header.items()]
        lines.append("")
        body = [table.markdown() for table in self.tables.values()]
        tail = ["### Skipped", "", *(f"- {s}" for s in self.skipped), ""] if self.skipped else []
        return "\n".join(lines) + "\n" + "\n".join(body) + "\n".join(tail)

    def save(self) -> None:
        with self._lock:
            self.out.mkdir(parents=True, exist_ok=True)
            document = {
                "header": self.header,
                "records": self.records,
                "skipped": self.skipped,
                "tables": {k: t.__dict__ for k, t in self.tables.items()},
            }
            (self.out / "gpu-bench.json").write_text(json.dumps(document, indent=1, default=str))
            (self.out / "gpu-bench.md").write_text(self.markdown())


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def median_spread(values: list[float]) -> str:
    if len(values) < 2:
        return f"{median(values):.1f}"
    return f"{median(values):.1f} ({min(values):.1f}-{max(values):.1f})"
