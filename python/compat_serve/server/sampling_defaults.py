"""What a request gets for the sampling settings it does not send.

Clients such as Claude Code send no temperature; 1.0 makes a small model ramble. For each
of `temperature`, `top_p` and `top_k` the default is, first found:

1. the model's own `generation_config.json` value, as vLLM does (`--generation-config
   auto`);
2. the operator's `--default-temperature` / `--default-top-p` / `--default-top-k`;
3. the model's fallback: values its publisher recommends elsewhere (the embedded
   SmolLM2's model card; its `generation_config.json` states none);
4. the built-in 1.0 / 1.0 / 0 (off).

`--generation-config none` (vLLM's flag) drops 1 and 3: the model supplies nothing, so
an operator can put their own values over a model's file.

A flag the model's file shadows is named in the startup log. A value the request sends
always wins.

Every API reaches the engine through `server.generation.submit`, which calls
`SamplingDefaults.apply`; an adapter only has to leave unsent fields as None.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from compat_serve.engine.types import SamplingParams

BUILT_IN = "built-in"
FLAG = "command line"
GENERATION_CONFIG_CHOICES = ("auto", "none")
FIELDS = ("temperature", "top_p", "top_k")
FLAG_NAMES = {
    "temperature": "--default-temperature",
    "top_p": "--default-top-p",
    "top_k": "--default-top-k",
}


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # Where each value came from: a file name, "command line", a fallback's name or
    # "built-in".
    sources: dict[str, str] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(FIELDS, BUILT_IN)
    )
    # Flags given but unused because the model's file sets that field (for the log).
    shadowed_flags: dict[str, float | int] = dataclasses.field(default_factory=dict)

    def apply(self, sampling: SamplingParams) -> SamplingParams:
        """`sampling` with every field the request left unset (None) filled in."""
        return dataclasses.replace(
            sampling,
            temperature=self.temperature if sampling.temperature is None else sampling.temperature,
            top_p=self.top_p if sampling.top_p is None else sampling.top_p,
            top_k=self.top_k if sampling.top_k is None else sampling.top_k,
        )

    def as_dict(self) -> dict[str, Any]:
        """For `/v1/models`, `/v1/status` and the startup log."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "sources": dict(self.sources),
        }

    def describe(self) -> str:
        return ", ".join(self._describe_one(name) for name in FIELDS)

    def _describe_one(self, name: str) -> str:
        source = self.sources[name]
        if name in self.shadowed_flags:
            source += (
                f"; {FLAG_NAMES[name]} {self.shadowed_flags[name]} is used only when the "
                "model sets none; --generation-config none to ignore the model's file"
            )
        return f"{name} {getattr(self, name)} ({source})"


def resolve_sampling_defaults(
    generation_config: dict[str, Any],
    generation_source: str,
    *,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    fallback: dict[str, Any] | None = None,
    fallback_source: str = "",
) -> SamplingDefaults:
    """The defaults for one model: its `generation_config` values (from
    `generation_source`), else the flags given (not None), else `fallback` (from
    `fallback_source`), else the built-in ones. Values of the wrong type or out of range
    in the model's file or fallback are ignored."""
    flags: dict[str, float | int | None] = {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
    }
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    shadowed: dict[str, float | int] = {}
    built_in = SamplingDefaults()
    for name, flag in flags.items():
        from_model = _valid(name, generation_config.get(name))
        from_fallback = _valid(name, (fallback or {}).get(name))
        if from_model is not None:
            values[name], sources[name] = from_model, generation_source
            if flag is not None:
                shadowed[name] = flag
        elif flag is not None:
            values[name], sources[name] = flag, FLAG
        elif from_fallback is not None:
            values[name], sources[name] = from_fallback, fallback_source
        else:
            values[name], sources[name] = getattr(built_in, name), BUILT_IN
    return SamplingDefaults(
        float(values["temperature"]),
        float(values["top_p"]),
        int(values["top_k"]),
        sources,
        shadowed,
    )


def check_sampling_flags(temperature: float | None, top_p: float | None, top_k: int | None) -> None:
    """Raise ValueError naming the flag for a value no request could send either."""
    if temperature is not None and not 0 <= temperature <= 2:
        raise ValueError("--default-temperature must be between 0 and 2")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError("--default-top-p must be greater than 0 and at most 1")
    if top_k is not None and top_k < 0:
        raise ValueError("--default-top-k must be 0 (off) or more")


def check_generation_config_choice(choice: str) -> None:
    if choice not in GENERATION_CONFIG_CHOICES:
        raise ValueError(
            f"--generation-config must be one of {', '.join(GENERATION_CONFIG_CHOICES)}"
        )


def _valid(name: str, value: Any) -> float | int | None:
    """A generation_config value usable as a default, or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if name == "temperature":
        return float(value) if 0 <= value <= 2 else None
    if name == "top_p":
        return float(value) if 0 < value <= 1 else None
    # top_k: a file that states it is taken at its word; 0 or negative (-1) means off.
    return max(0, int(value)) if value == int(value) else None
