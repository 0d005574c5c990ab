"""Turn serve options into a ready ServerState: load the model, the template, the engine."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from compat_serve.chat.prompt import PromptBuilder
from compat_serve.engine.config import EngineConfig
from compat_serve.engine.engine import Engine
from compat_serve.engine.kv_quant import KVFormat
from compat_serve.engine.memory import parse_memory_size
from compat_serve.engine.speculation import SpeculationConfig
from compat_serve.models.loader import load_model, read_chat_template_file, replace_chat_template
from compat_serve.models.types import LoadedModel
from compat_serve.models.weights import DTYPE_CHOICES
from compat_serve.parsers import OutputParsing
from compat_serve.parsers.formats.envelope import ENVELOPE_FORMAT
from compat_serve.parsers.registry import (
    check_parser_choices,
    resolve_reasoning,
    resolve_tool_format,
)
from compat_serve.server.reasoning_budgets import (
    DEFAULT_LEVELS,
    ReasoningBudgets,
    parse_levels,
)
from compat_serve.server.sampling_defaults import (
    check_generation_config_choice,
    check_sampling_flags,
    resolve_sampling_defaults,
)
from compat_serve.server.state import ServerState

log = logging.getLogger("compat_serve")


@dataclass(frozen=True)
class ServeOptions:
    model: str | None = None
    served_model_name: str | None = None
    api_key: str | None = None
    chat_template: str | None = None
    inline_system: str = "auto"
    # Which echoed replies continue from their generated tokens (chat/reply_history.py).
    reply_history: str = "loop"
    # An integer, "auto" (what one sequence's KV can hold), or None (the model's own).
    context_length: int | str | None = None
    prefill_chunk: int = 512
    decode_prefill_chunk: int | None = None
    max_num_seqs: int = 16
    speculative: str = "off"
    speculative_tokens: int | str = 4  # or "auto"
    ngram_min: int = 2
    ngram_max: int = 4
    draft_model: str | None = None
    mtp_head: str | None = None
    max_num_batched_tokens: int | None = None
    kv_memory: str = "30%"
    # Quantized KV (engine/kv_quant.py): None = the model's dtype; strings as typed.
    kv_bits: int | str | None = None
    kv_group_size: int | str = 64
    prefix_cache: bool = True
    block_size: int = 16
    cache_memory: str = "20%"
    cache_pin_fraction: float = 0.5
    cache_hash: str = "xxh3"
    cache_dir: str | None = None
    cache_disk_size: str = "25%"
    cache_salt_per_key: bool = False
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    max_queue: int = 256
    strict_model_names: bool = False
    max_output_tokens: int | None = None
    max_tool_rounds: int | None = None
    reasoning_budget: int | None = None
    reasoning_budgets: str | None = None
    max_request_bytes: int = 32 * 1024 * 1024
    default_temperature: float | None = None
    default_top_p: float | None = None
    default_top_k: int | None = None
    generation_config: str = "auto"
    tool_parser: str = "auto"
    reasoning_parser: str = "auto"
    # One model over several ranks (distributed/): "tensor", "pipeline" or None.
    distributed: str | None = None
    # How the weights are held (models/weights.py `resolve_dtype`): auto, quantized (the
    # users' path on any machine: weights as stored, stock mlx-lm modules), float16,
    # bfloat16 or float32.
    dtype: str = "auto"
    # --memory-budget in bytes (several models): `--dtype auto` keeps weights as stored
    # when float32 would not fit it (models/auto_dtype.py). None: half the machine's memory.
    memory_budget_bytes: int | None = None


def _engine_config(options: ServeOptions) -> EngineConfig:
    if options.max_num_seqs < 1:
        raise ValueError("--max-num-seqs must be at least 1")
    config = EngineConfig(
        prefill_chunk=options.prefill_chunk,
        decode_prefill_chunk=options.decode_prefill_chunk,
        max_queue=options.max_queue,
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens,
        kv_memory_bytes=_memory_option(options.kv_memory, "30%"),
        prefix_cache=options.prefix_cache,
        block_size=options.block_size,
        cache_memory_bytes=_memory_option(options.cache_memory, "20%"),
        cache_pin_fraction=options.cache_pin_fraction,
        cache_hash=options.cache_hash,
        cache_dir=options.cache_dir,
        cache_disk_bytes=_disk_size(options),
        kv_events_endpoint=options.kv_events_endpoint,
        kv_events_replay_endpoint=options.kv_events_replay_endpoint,
        kv_events_topic=options.kv_events_topic,
        kv_format=_kv_format(options),
        auto_context=options.context_length == "auto",
        speculation=SpeculationConfig(
            options.speculative,
            options.speculative_tokens,
            options.ngram_min,
            options.ngram_max,
            draft_model=options.draft_model,
            mtp_head=options.mtp_head,
        ),
    )
    config.validate()  # before the model loads: a bad flag fails fast
    return config


def _memory_option(value: str, default: str) -> int | None:
    """Bytes of a memory flag; None for the default share, which the engine takes of what
    the device has left after the weights (engine/memory.py)."""
    return None if value == default else parse_memory_size(value)


def _kv_format(options: ServeOptions) -> KVFormat:
    """--kv-bits and --kv-group-size, checked: a bad value names the flag and its choices."""
    bits = _flag_int(options.kv_bits, "--kv-bits", "8 or 4")
    group = _flag_int(options.kv_group_size, "--kv-group-size", "32, 64 or 128")
    kv_format = KVFormat(bits, 64 if group is None else group)
    kv_format.validate()
    return kv_format


def _flag_int(value: int | str | None, flag: str, allowed: str) -> int | None:
    if value is None or isinstance(value, int):
        return value
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{flag} must be {allowed}, not {value!r}") from None


def context_length_option(value: int | str | None) -> int | str | None:
    """--context-length: None, "auto", or an integer of at least 2."""
    if value is None or value == "auto":
        return value
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"--context-length must be auto or an integer >= 2, not {value!r}"
        ) from None
    if number < 2:
        raise ValueError(f"--context-length must be auto or an integer >= 2, not {value}")
    return number


def _disk_size(options: ServeOptions) -> int | None:
    """Bytes for --cache-disk-size; a percentage is of the free space under --cache-dir."""
    if options.cache_dir is None:
        return None
    path = Path(options.cache_dir)
    path.mkdir(parents=True, exist_ok=True)
    return parse_memory_size(options.cache_disk_size, total=shutil.disk_usage(path).free)


def reasoning_budgets(options: ServeOptions) -> ReasoningBudgets:
    """--reasoning-budgets (over the default levels) and --reasoning-budget."""
    levels = dict(DEFAULT_LEVELS)
    if options.reasoning_budgets:
        levels.update(parse_levels(options.reasoning_budgets))
    return ReasoningBudgets(levels, options.reasoning_budget)


def check_serve_options(options: ServeOptions) -> EngineConfig:
    """The checks that need no model, so a typo fails before a multi-second load; the
    engine configuration they yield."""
    if options.prefill_chunk < 1:
        raise ValueError("--prefill-chunk must be at least 1")
    if options.max_output_tokens is not None and options.max_output_tokens < 1:
        raise ValueError("--max-output-tokens must be at least 1")
    if options.max_tool_rounds is not None and options.max_tool_rounds < 1:
        raise ValueError("--max-tool-rounds must be at least 1")
    if options.reasoning_budget is not None and options.reasoning_budget < 0:
        raise ValueError("--reasoning-budget cannot be negative")
    reasoning_budgets(options)
    if options.max_request_bytes < 1024:
        raise ValueError("--max-request-bytes must be at least 1024")
    check_sampling_flags(options.default_temperature, options.default_top_p, options.default_top_k)
    check_generation_config_choice(options.generation_config)
    if options.max_queue < 1:
        raise ValueError("--max-queue must be at least 1")
    if options.dtype not in DTYPE_CHOICES:
        raise ValueError(
            f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, not {options.dtype!r}"
        )
    engine_config = _engine_config(options)
    context_length_option(options.context_length)
    check_parser_choices(options.tool_parser, options.reasoning_parser)
    return engine_config


def build_state(options: ServeOptions, loaded: LoadedModel | None = None) -> ServerState:
    """Build everything but do not start the engine (the app's lifespan starts it)."""
    engine_config = check_serve_options(options)
    template = read_chat_template_file(options.chat_template) if options.chat_template else None
    context_length = context_length_option(options.context_length)
    if loaded is None:
        loaded = load_model(
            options.model, dtype=options.dtype, memory_budget=options.memory_budget_bytes
        )
    if template is not None and options.chat_template is not None:
        loaded = replace_chat_template(loaded, template, options.chat_template)
    if isinstance(context_length, int):
        loaded = dataclasses.replace(loaded, context_length=context_length)
    builder = PromptBuilder(
        loaded.chat_template,
        loaded.tokenizer,
        inline_system=options.inline_system,
        reply_history=options.reply_history,
    )
    if not builder.has_template:
        log.warning(
            "the model has no chat template: chat requests are answered 400 (pass "
            "--chat-template FILE, or use /v1/completions or Ollama's raw generate)"
        )
    output_parsing = _output_parsing(options, loaded)
    if builder.has_template and not builder.traits.renders_tools:
        if options.tool_parser == "auto":
            builder.injects_tools = True
            output_parsing.tool_format = ENVELOPE_FORMAT
            log.warning(
                "the chat template ignores tool definitions: tools are described in the "
                "system prompt and the model answers in a JSON envelope (a list of calls "
                "or a text response), enforced by a grammar; pass --chat-template with a "
                "tool-aware template to use the model's own format"
            )
        else:
            log.warning(
                "the chat template ignores tool definitions and --tool-parser %s is set: "
                "clients' tools will not reach the model",
                options.tool_parser,
            )
    traits = builder.traits
    model_sampling = options.generation_config == "auto"
    sampling_defaults = resolve_sampling_defaults(
        loaded.generation_config if model_sampling else {},
        loaded.generation_config_source,
        temperature=options.default_temperature,
        top_p=options.default_top_p,
        top_k=options.default_top_k,
        fallback=loaded.fallback_sampling if model_sampling else {},
        fallback_source=loaded.fallback_sampling_source,
    )
    # A flag the model's file shadows is a warning: the operator typed it for a reason.
    log.log(
        logging.WARNING if sampling_defaults.shadowed_flags else logging.INFO,
        "sampling defaults for requests that send none: %s",
        sampling_defaults.describe(),
    )
    engine = Engine(loaded, engine_config)
    loaded = engine.model  # --context-length auto: the window the KV budget holds
    name = options.served_model_name or loaded.name
    engine.vllm_metrics.model_name = name
    log.info(
        "model %s (%s, %s, %s): context %d tokens, inline-system policy %s (%s)%s, "
        "echoed replies continue as generated: %s",
        name,
        loaded.model_type,
        loaded.dtype,
        loaded.source,
        loaded.context_length,
        traits.inline_system,
        traits.inline_system_reason,
        ", merging same-role turns" if traits.requires_alternation else "",
        options.reply_history,
    )
    return ServerState(
        engine=engine,
        prompt_builder=builder,
        served_model_name=name,
        context_length=loaded.context_length,
        api_key=options.api_key,
        strict_model_names=options.strict_model_names,
        inline_system_policy=traits.inline_system,
        max_request_bytes=options.max_request_bytes,
        max_output_tokens=options.max_output_tokens,
        max_tool_rounds=options.max_tool_rounds,
        reasoning_budgets=reasoning_budgets(options),
        sampling_defaults=sampling_defaults,
        output_parsing=output_parsing,
        cache_salt_per_key=options.cache_salt_per_key,
    )


def _output_parsing(options: ServeOptions, loaded: LoadedModel) -> OutputParsing:
    parsing = OutputParsing(
        resolve_tool_format(options.tool_parser, loaded.chat_template),
        resolve_reasoning(options.reasoning_parser, loaded.chat_template),
        loaded.tokenizer,
    )
    log.info("output parsing: %s", parsing.describe())
    return parsing
