"""Speculative decoding: drafters propose tokens per row, the executor verifies them.

A `Drafter` proposes up to `k` tokens to follow a request's prompt plus output. The
executor feeds every row's last token and its draft through one batched forward
(`ModelRunner.verify_logits`, rows right-padded to the longest draft), keeps the longest
prefix the model agrees with (greedy: equal to its argmax; sampled: the speculative
sampling rule in `sampling.accept_draft`), adds the model's own next token, and rolls
back each row's rejected positions (`DecodeBatch.rollback`; sliding windows and recurrent
state as engine/verify_rollback.py explains). The scheduler, stop strings,
grammar and usage then see the accepted tokens one by one, exactly as if each had been
decoded on its own.

`NGramDrafter` is prompt lookup: the tokens that followed the most recent earlier
occurrence of the longest suffix (n_max down to n_min tokens) of the sequence. Coding
agents copy a lot (rewriting a file with a small change, quoting tool output), so these
drafts are often long and right; in free text they rarely exist, and then the step is
the ordinary one-token decode. `RowState` backs off a row whose drafts keep missing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from compat_serve.engine.speculation_depth import AUTO, AUTO_MAX_DEPTH, DepthTuner
from compat_serve.engine.step_costs import StepCosts

if TYPE_CHECKING:
    from compat_serve.engine.mtp_head import MTPHead
    from compat_serve.models.types import LoadedModel

log = logging.getLogger("compat_serve.engine")

MODES = ("off", "ngram", "draft", "mtp")


@dataclass(frozen=True)
class SpeculationConfig:
    mode: str = "off"
    # Most tokens drafted per row per step, or "auto" (engine/speculation_depth.py: the
    # depth chosen from measured acceptance and step cost, at most AUTO_MAX_DEPTH).
    num_tokens: int | str = 4
    # Suffix lengths prompt lookup tries, longest first.
    ngram_min: int = 2
    ngram_max: int = 4
    # Verify only when the measured cost pays for the expected tokens (`StepCosts`);
    # False verifies every draft (tests of the drafting paths).
    cost_aware: bool = True
    # The draft model (`--speculative draft --draft-model DIR`; engine/draft_model.py):
    # its path, loaded by the engine, or the model itself.
    draft_model: str | None = None
    draft: LoadedModel | None = field(default=None, compare=False, repr=False)
    # Multi-token prediction (`--speculative mtp`; engine/mtp_head.py): a head file for a
    # model that ships none (`--mtp-head FILE`), and the head the engine built.
    mtp_head: str | None = None
    mtp: MTPHead | None = field(default=None, compare=False, repr=False)

    @property
    def auto_depth(self) -> bool:
        return self.num_tokens == AUTO

    @property
    def max_depth(self) -> int:
        """The deepest draft a row may ever be given."""
        return self.num_tokens if isinstance(self.num_tokens, int) else AUTO_MAX_DEPTH

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--speculative must be one of {', '.join(MODES)}")
        has_draft = self.draft is not None or bool(self.draft_model)
        if self.mode == "draft" and not has_draft:
            raise ValueError("--speculative draft needs --draft-model DIR")
        if self.mode != "draft" and has_draft:
            raise ValueError("--draft-model is only used with --speculative draft")
        if self.mode != "mtp" and (self.mtp_head or self.mtp is not None):
            raise ValueError("--mtp-head is only used with --speculative mtp")
        if self.num_tokens != AUTO and (
            not isinstance(self.num_tokens, int)
            or isinstance(self.num_tokens, bool)
            or self.num_tokens < 1
        ):
            raise ValueError(
                f"--speculative-tokens must be a positive integer or auto, not {self.num_tokens!r}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("--ngram-min must be at least 1 and at most --ngram-max")


class Drafter(Protocol):
    def propose(self, key: str, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens likely to follow `tokens` (the row's prompt plus output)."""

    def forget(self, key: str) -> None:
        """The row `key` ended: drop what was kept for it."""


class _NGramIndex:
    """For each n, the end position of the latest occurrence of every n-gram, built
    incrementally as the sequence grows (positions before `indexed`)."""

    def __init__(self, sizes: range) -> None:
        self.sizes = sizes
        self.last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.indexed = 0  # n-grams ending before this position are indexed

    def extend(self, tokens: list[int], end: int) -> None:
        for stop in range(max(self.indexed, 1), end + 1):
            for n in self.sizes:
                if stop >= n:
                    self.last[n][tuple(tokens[stop - n : stop])] = stop
        self.indexed = max(self.indexed, end + 1)


class NGramDrafter:
    """Prompt lookup over each row's prompt plus output."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self._sizes = range(ngram_max, ngram_min - 1, -1)
        self._rows: dict[str, _NGramIndex] = {}

    def propose(self, key: str, tokens: list[int], k: int) -> list[int]:
        index = self._rows.get(key)
        if index is None or index.indexed > len(tokens):  # new, or recomputed shorter
            index = self._rows[key] = _NGramIndex(self._sizes)
        end = len(tokens)
        # Index every n-gram that ends before the last position, so a lookup of the
        # current suffix finds an earlier occurrence, never itself.
        index.extend(tokens, end - 1)
        for n in self._sizes:
            if end < n:
                continue
            stop = index.last[n].get(tuple(tokens[end - n :]))
            if stop is not None:
                return tokens[stop : stop + k]
        return []

    def forget(self, key: str) -> None:
        self._rows.pop(key, None)


@dataclass
class RowState:
    """Adaptive draft length per row: grows while drafts are accepted, halves on a miss;
    a row that misses again and again drafts nothing for a growing number of steps.
    `rate` estimates the chance that the next drafted token is accepted (per-token
    hits over trials, decayed so it follows the row's recent text)."""

    limit: int
    k: int = 0
    misses: int = 0
    cooldown: int = 0
    hits: float = 0.0
    trials: float = 0.0
    # The request's totals, for /v1/status.
    drafted: int = 0
    accepted: int = 0

    def __post_init__(self) -> None:
        self.k = self.limit

    @property
    def rate(self) -> float:
        return (self.hits + 1.0) / (self.trials + 2.0)

    def wants_draft(self) -> bool:
        if self.cooldown > 0:
            self.cooldown -= 1
            return False
        return True

    def record(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        # Drafts are accepted token by token until the first miss: `accepted` hits, and
        # one failed trial unless the whole draft was kept.
        self.hits = RATE_DECAY * self.hits + accepted
        self.trials = RATE_DECAY * self.trials + accepted + (accepted < drafted)
        if accepted == drafted:
            self.k = min(self.limit, self.k + 1)
            self.misses = 0
        elif accepted == 0:
            self.k = max(1, self.k // 2)
            self.misses += 1
            if self.misses >= 2:
                self.cooldown = min(2 ** (self.misses - 1), 32)
        else:
            self.k = max(1, accepted + 1)
            self.misses = 0


RATE_DECAY = 0.8


@dataclass
class SpeculationStats:
    """Counters for /metrics, /v1/status and the dashboard (written by the engine
    thread). Per draft position i (1-based): `proposed_at[i - 1]` drafts proposed a
    token there, `accepted_at[i - 1]` of them had it accepted; they add up to `drafted`
    and `accepted`. `depth` is the deepest draft in use (`--speculative-tokens`, or the
    one `auto` chose: `tuner`), `last_depth` the longest draft of the last verify step."""

    mode: str
    steps: int = 0
    # Rows verified over all verify steps (a row without a draft counts too).
    row_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    # Verified rows that had a draft (the mean draft depth is `drafted` over these).
    drafting_rows: int = 0
    depth: int = 0
    last_depth: int = 0
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    tuner: DepthTuner | None = None
    disabled_reason: str | None = None
    per_row: dict[str, RowState] = field(default_factory=dict)
    costs: StepCosts = field(default_factory=StepCosts)

    def record(self, drafted: int, accepted: int) -> None:
        """One verified row: `drafted` tokens proposed, the first `accepted` kept (what it
        emitted is counted as it is handed on: `emitted`)."""
        self.drafted += drafted
        self.accepted += accepted
        if not drafted:
            return
        self.drafting_rows += 1
        while len(self.proposed_at) < drafted:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for i in range(drafted):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < accepted
        if self.tuner is not None:
            self.tuner.record(drafted, accepted)

    def positions(self) -> list[dict[str, object]]:
        return [
            {
                "position": i + 1,
                "draft_tokens": proposed,
                "accepted_tokens": accepted,
                "acceptance_rate": round(accepted / proposed, 4) if proposed else None,
            }
            for i, (proposed, accepted) in enumerate(
                zip(self.proposed_at, self.accepted_at, strict=True)
            )
        ]

    def step_costs(self) -> list[dict[str, object]]:
        """Each measured shape's cost, and against a plain step of as many rows."""
        out: list[dict[str, object]] = []
        for (rows, width), seconds in sorted(self.costs.measured().items()):
            plain = self.costs.estimate(rows, 1)
            out.append(
                {
                    "rows": rows,
                    "width": width,
                    "ms": round(seconds * 1000, 2),
                    "vs_plain": round(seconds / plain, 3) if plain else None,
                }
            )
        return out

    def status(self) -> dict[str, object]:
        rate = self.accepted / self.drafted if self.drafted else None
        return {
            "mode": self.mode if self.disabled_reason is None else "off",
            "disabled_reason": self.disabled_reason,
            "verify_steps": self.steps,
            "draft_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "emitted_tokens": self.emitted,
            "verified_rows": self.row_steps,
            "acceptance_rate": round(rate, 4) if rate is not None else None,
            "tokens_per_verify_step": round(self.emitted / self.steps, 3) if self.steps else None,
            "tokens_per_verified_row": (
                round(self.emitted / self.row_steps, 3) if self.row_steps else None
            ),
            "draft_depth": {
                "max": self.depth,
                "auto": self.tuner is not None,
                "auto_choices": self.tuner.choices if self.tuner is not None else None,
                "last": self.last_depth,
                "mean": (
                    round(self.drafted / self.drafting_rows, 3) if self.drafting_rows else None
                ),
            },
            "positions": self.positions(),
            "step_costs_ms": self.costs.status(),
            "step_costs": self.step_costs(),
        }

    def render(self) -> list[str]:
        lines = []
        for name, help_text, value in (
            ("compat_spec_verify_steps_total", "Decode steps that verified drafts.", self.steps),
            ("compat_spec_draft_tokens_total", "Tokens drafted for verification.", self.drafted),
            (
                "compat_spec_accepted_tokens_total",
                "Drafted tokens the model accepted.",
                self.accepted,
            ),
            (
                "compat_spec_emitted_tokens_total",
                "Tokens verify steps emitted (accepted plus one per row, less what "
                "followed the end of a request).",
                self.emitted,
            ),
            (
                "compat_spec_drafting_rows_total",
                "Verified rows that had a draft (mean draft depth: draft tokens over these).",
                self.drafting_rows,
            ),
        ):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
        for name, help_text, values in (
            (
                "compat_spec_position_draft_tokens_total",
                "Drafts that proposed a token at this draft position (1: the first).",
                self.proposed_at,
            ),
            (
                "compat_spec_position_accepted_tokens_total",
                "Drafts whose token at this draft position was accepted.",
                self.accepted_at,
            ),
        ):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
            lines += [f'{name}{{position="{i + 1}"}} {v}' for i, v in enumerate(values)]
        rate = self.accepted / self.drafted if self.drafted else 0.0
        mean = self.drafted / self.drafting_rows if self.drafting_rows else 0.0
        for name, help_text, gauge in (
            ("compat_spec_acceptance_rate", "Accepted over drafted tokens since start.", rate),
            (
                "compat_spec_draft_depth",
                "Deepest draft in use (--speculative-tokens, or the one auto chose).",
                self.depth,
            ),
            ("compat_spec_draft_depth_mean", "Mean tokens per draft since start.", mean),
        ):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {gauge:.6g}"]
        name = "compat_spec_step_cost_seconds"
        lines += [
            f"# HELP {name} Measured wall time of a decode step of rows x width positions "
            "(width 1: a plain step; wider: a verify step, drafting included).",
            f"# TYPE {name} gauge",
        ]
        lines += [
            f'{name}{{rows="{rows}",width="{width}"}} {seconds:.6g}'
            for (rows, width), seconds in sorted(self.costs.measured().items())
        ]
        return lines
