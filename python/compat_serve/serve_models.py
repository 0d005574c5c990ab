"""Turn serve options and the model flags (`--model`, `--models-dir`, `--models`,
`--memory-budget`) into a `ModelHub`: the registry, the models loaded at start, and the
MLX work of loading and releasing a model for the hub to call.

Single-model mode is a hub of one: `--model PATH` (or nothing: the embedded model) is
loaded at start as before, pinned, and the default for every unknown name. Every
model's engine is stepped by one `EngineHost` thread (engine/host.py), and a model loaded
on demand has every MLX evaluation of its load (weights a slice at a time, then the
engine's start-up forwards) run on that thread between the resident models' steps
(`load_state_steps`); only file reading and tokenizers run on a worker thread.

An embedding or reranker model (#37, detected from its directory: embeddings/detect.py)
is an entry like any other: it loads through its own loader into an `EmbeddingState`
whose engine the same host steps (embeddings/scheduler.py), and counts its weights
alone against the budget (it keeps no KV and no prefix cache).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

from compat_serve.bootstrap import ServeOptions, build_state, check_serve_options
from compat_serve.engine.host import EngineHost
from compat_serve.engine.memory import headroom_bytes, parse_memory_size, plan_memory
from compat_serve.models.auto_dtype import choose_auto_dtype
from compat_serve.models.device_memory import collect_memory, device_memory
from compat_serve.models.load_steps import LoadSteps, host, note_evaluation
from compat_serve.models.resident_size import estimate_resident_bytes
from compat_serve.models.weight_estimate import estimate_weight_bytes
from compat_serve.registry.adapters import parse_lora_flag
from compat_serve.registry.config_file import load_models_file
from compat_serve.registry.entries import ModelEntry, entries_from_dir
from compat_serve.registry.hub import ModelHub
from compat_serve.registry.routing import ModelRegistry
from compat_serve.registry.slots import add_adapters, path_kind
from compat_serve.server.state import ServedState, ServerState

log = logging.getLogger("compat_serve")

SINGLE_ORIGIN = "--model"
# Shares of the device's spare memory a model's KV and prefix cache take by default (as
# bootstrap's --kv-memory and --cache-memory defaults).
_KV_SHARE, _CACHE_SHARE = 0.30, 0.20


@dataclasses.dataclass(frozen=True)
class ModelFlags:
    models_dir: str | None = None
    models_file: str | None = None
    # Bytes or a share of the device ("60%"); None: the device less its headroom.
    memory_budget: str | None = None
    # Seconds a request waits for memory before it is answered overloaded.
    wait_timeout_s: float = 300.0
    # `--lora NAME=PATH` flags: adapters of the --model (else the default model).
    loras: tuple[str, ...] = ()


def entry_options(base: ServeOptions, entry: ModelEntry) -> ServeOptions:
    """The serve options of one model: the command line's, its own on top. Each model
    of a registry keeps its disk tier in its own directory under --cache-dir."""
    overrides = dict(entry.options)
    if (
        "cache_dir" not in overrides
        and base.cache_dir is not None
        and entry.origin != SINGLE_ORIGIN
    ):
        overrides["cache_dir"] = str(Path(base.cache_dir) / entry.id)
    name = base.served_model_name if entry.origin == SINGLE_ORIGIN else entry.id
    return dataclasses.replace(base, model=entry.path, served_model_name=name, **overrides)


def memory_budget(text: str | None) -> int:
    """--memory-budget in bytes; by default the device's memory less its headroom."""
    device, _ = device_memory()
    if text is None:
        return device - headroom_bytes(device)
    return parse_memory_size(text, total=device)


def estimate_bytes(base: ServeOptions, entry: ModelEntry) -> int:
    """What a model will hold, before it is loaded: its weights as the loader will make
    them (read from its files' headers under the weight plan of its dtype, e.g. float32
    on the CPU, or as stored where float32 would not fit: models/auto_dtype.py), its
    tokenizer (models/resident_size.py), and the KV and prefix-cache memory the command
    line sets aside (--kv-memory / --cache-memory as sizes; the default shares are limits
    the engine fills, not memory a loaded model holds). The one estimate admission,
    eviction and the never-fits refusal all use; after a load the hub checks it against
    what the engine measured."""
    options = entry_options(base, entry)
    if path_kind(entry.path) != "chat":
        return estimate_weight_bytes(entry.path, options.dtype or "auto")  # no KV, no cache
    dtype = choose_auto_dtype(entry.path, options.dtype, base.memory_budget_bytes).dtype
    weights = estimate_resident_bytes(entry.path, dtype or "auto")
    kv = None if options.kv_memory == "30%" else parse_memory_size(options.kv_memory)
    cache = None if options.cache_memory == "20%" else parse_memory_size(options.cache_memory)
    if not options.prefix_cache:
        cache = 0
    plan = plan_memory(weights, kv, cache, _KV_SHARE, _CACHE_SHARE)
    return plan.weights + plan.reserved


def load_state_steps(options: ServeOptions) -> LoadSteps[ServerState]:
    """`build_state(options)` as load steps (models/load_steps.py): the model's weights a
    slice at a time, then the engine (its start-up forwards, and a draft model's load if
    it has one) in one host slice."""
    from compat_serve.models.loader import load_model_steps

    loaded = yield from load_model_steps(
        options.model, dtype=options.dtype, memory_budget=options.memory_budget_bytes
    )
    yield host("engine start-up")
    state = build_state(options, loaded)
    note_evaluation("engine start-up", 0)
    return state


def served_state(options: ServeOptions) -> ServedState:
    """`build_state`, or an embedding model's state for an embedding/reranker model."""
    if path_kind(options.model) != "chat":
        from compat_serve.embeddings.state import build_embedding_state

        return build_embedding_state(options)
    return build_state(options)


def served_state_steps(options: ServeOptions) -> LoadSteps[ServedState]:
    """`served_state` as load steps (on the host's thread, between the others' steps)."""
    if path_kind(options.model) != "chat":
        from compat_serve.embeddings.state import embedding_state_steps

        return (yield from embedding_state_steps(options))
    return (yield from load_state_steps(options))


async def load_with_adapters(
    engine_host: EngineHost, base: ServeOptions, entry: ModelEntry, registry: ModelRegistry
) -> ServedState:
    """A model loaded on demand, with the adapters it serves added on the host thread
    (their MLX arrays are made there, between the resident models' steps)."""
    state = await engine_host.run_steps(served_state_steps(entry_options(base, entry)))
    adapters = registry.adapters.of(entry.id)
    if adapters:
        await asyncio.wrap_future(
            engine_host.run_slice(lambda: add_adapters(state, adapters), "adapters")
        )
    return state


def release_state(state: ServedState) -> None:
    """Stop a model's engine (its disk tier is flushed and kept for the next load)."""
    state.engine.shutdown()


def with_lora_flags(entries: list[ModelEntry], loras: tuple[str, ...]) -> list[ModelEntry]:
    """`--lora` adapters added to the `--model` entry (first when present), else to the
    registry's default model (ValueError for a malformed flag or a path that is no
    adapter; the registry then checks the names)."""
    if not loras:
        return entries
    adapters = tuple(parse_lora_flag(text) for text in loras)
    target = next((e for e in entries if e.origin == SINGLE_ORIGIN), None)
    target = target or next((e for e in entries if e.default), entries[0])
    return [
        dataclasses.replace(e, adapters=e.adapters + adapters) if e is target else e
        for e in entries
    ]


def check_adapter_bases(entries: list[ModelEntry]) -> None:
    """LoRA adapters apply to chat models: a ValueError (before anything loads on demand)
    for adapters on an embedding or reranker model."""
    for entry in entries:
        kind = path_kind(entry.path) if entry.adapters else "chat"
        if kind != "chat":
            raise ValueError(
                f"{entry.origin}: model {entry.id!r} is {'an' if kind[0] in 'aeiou' else 'a'} "
                f"{kind} model; LoRA adapters "
                f"({', '.join(a.name for a in entry.adapters)}) apply to chat models only"
            )


def build_hub(
    base: ServeOptions, flags: ModelFlags, single_state: ServedState | None = None
) -> ModelHub[ServerState]:
    """The registry, with `--model` (or, with no model flags at all, the embedded model)
    and every pinned or preloaded model loaded now. `single_state`: that model already
    built (rank 0 of `--distributed`, on its sharded weights)."""
    entries: list[ModelEntry] = []
    if flags.models_file is not None:
        entries += load_models_file(flags.models_file)
    if flags.models_dir is not None:
        entries += entries_from_dir(flags.models_dir)
    for entry in entries:  # every model's options, checked before anything loads
        try:
            check_serve_options(entry_options(base, entry))
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"{entry.origin}: model {entry.id!r}: {exc}") from exc
    budget = memory_budget(flags.memory_budget) if entries else None
    base = dataclasses.replace(base, memory_budget_bytes=budget)
    if single_state is None and (base.model is not None or not entries):
        single_state = served_state(base)
    if single_state is not None:
        entries.insert(
            0,
            ModelEntry(
                single_state.served_model_name,
                base.model,
                pin=True,
                preload=True,
                default=not any(e.default for e in entries),
                origin=SINGLE_ORIGIN,
            ),
        )
    entries = with_lora_flags(entries, flags.loras)
    check_adapter_bases(entries)
    registry = ModelRegistry(entries, strict=base.strict_model_names)
    engine_host = EngineHost()  # one thread steps every resident model, and runs loads' MLX work
    hub = ModelHub(
        registry,
        load=lambda entry: served_state(entry_options(base, entry)),
        load_async=lambda e: load_with_adapters(engine_host, base, e, registry),
        release=release_state,
        # gc and mx.clear_cache on the host thread, between steps.
        collect=lambda: engine_host.run_slice(collect_memory, "release memory").result(),
        estimate=lambda entry: estimate_bytes(base, entry),
        api_key=base.api_key,
        max_request_bytes=base.max_request_bytes,
        budget_bytes=budget,
        wait_timeout_s=flags.wait_timeout_s,
        start=lambda state: state.engine.start(engine_host),
    )
    if single_state is not None:
        single = registry.entries[0]
        # Alone (no budget), nothing reads its size: no estimate to check.
        estimate = None if budget is None else estimate_bytes(base, single)
        hub.adopt(single.id, single_state, estimate)
    for entry in registry.entries:
        if (entry.preload or entry.pin) and hub.slots[entry.id].state is None:
            need = hub.estimate(hub.slots[entry.id])
            if budget is not None and hub.resident_total() + need > budget:
                raise ValueError(
                    f"{entry.origin}: model {entry.id!r} is pinned or preloaded but does not fit "
                    f"--memory-budget ({need} bytes needed, {budget - hub.resident_total()} left)"
                )
            hub.adopt(entry.id, served_state(entry_options(base, entry)), need)
    log.info(
        "models: %s (default %s)",
        ", ".join(f"{e.id} [{hub.slots[e.id].status}]" for e in registry.entries),
        registry.default.id,
    )
    return hub
