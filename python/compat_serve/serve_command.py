"""The serve command: preflight the model, build the hub, print the banner, serve until drained.

`serve` takes the namespace `serve_flags.build_serve_parser` parsed; the CLI and the
launcher's child process (`launch/child.py`) both run it.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import time

from compat_serve import __version__

log = logging.getLogger("compat_serve")


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def serve(ns: argparse.Namespace) -> int:
    setup_logging(ns.log_level)
    # The dashboard's log panel (/v1/logs) keeps the lines from here on, loading included.
    from compat_serve.server.dashboard.log_ring import log_ring

    log_ring()
    if ns.shutdown_timeout < 0:
        log.error("--shutdown-timeout must be >= 0, not %s", ns.shutdown_timeout)
        return 2
    failure = _model_preflight(ns)
    if failure is not None:
        log.error("%s", failure)
        return 2
    # The fast BLAS must be loaded before anything imports mlx.core.
    from compat_serve.engine.mlx_threads import release_thread_mlx
    from compat_serve.models.blas import ensure_fast_blas

    ensure_fast_blas()
    # The main thread's MLX state goes before the interpreter does (the engine threads
    # free theirs as they end).
    atexit.register(release_thread_mlx)
    build = None
    if ns.distributed is not None:  # refusals before the heavy imports and the weights
        if ns.models_dir is not None or ns.models_file is not None:
            log.error("--distributed serves one model (--model): drop --models-dir / --models")
            return 2
        if ns.dtype != "auto":  # the ranks load their shards as stored (distributed/loading.py)
            log.error("--dtype is not applied with --distributed: drop --dtype %s", ns.dtype)
            return 2
        from compat_serve.distributed.startup import RankBuilder

        build = RankBuilder.preflight(vars(ns))
        if build is None:
            return 2
    from compat_serve.bootstrap import ServeOptions
    from compat_serve.serve_models import ModelFlags, build_hub

    started = time.monotonic()
    try:
        options = ServeOptions(
            model=ns.model,
            served_model_name=ns.served_model_name,
            api_key=ns.api_key,
            chat_template=ns.chat_template,
            inline_system=ns.inline_system,
            reply_history=ns.reply_history,
            context_length=ns.context_length,
            prefill_chunk=ns.prefill_chunk,
            decode_prefill_chunk=ns.decode_prefill_chunk,
            max_num_seqs=ns.max_num_seqs,
            speculative=ns.speculative,
            speculative_tokens=ns.speculative_tokens,
            ngram_min=ns.ngram_min,
            ngram_max=ns.ngram_max,
            draft_model=ns.draft_model,
            mtp_head=ns.mtp_head,
            max_num_batched_tokens=ns.max_num_batched_tokens,
            kv_memory=ns.kv_memory,
            kv_bits=ns.kv_bits,
            kv_group_size=ns.kv_group_size,
            prefix_cache=ns.prefix_cache,
            block_size=ns.block_size,
            cache_memory=ns.cache_memory,
            cache_pin_fraction=ns.cache_pin_fraction,
            cache_hash=ns.cache_hash,
            cache_dir=ns.cache_dir,
            cache_disk_size=ns.cache_disk_size,
            cache_salt_per_key=ns.cache_salt_per_key,
            kv_events_endpoint=ns.kv_events_endpoint,
            kv_events_replay_endpoint=ns.kv_events_replay_endpoint,
            kv_events_topic=ns.kv_events_topic,
            max_queue=ns.max_queue,
            strict_model_names=ns.strict_model_names,
            max_output_tokens=ns.max_output_tokens,
            max_tool_rounds=ns.max_tool_rounds,
            reasoning_budget=ns.reasoning_budget,
            reasoning_budgets=ns.reasoning_budgets,
            max_request_bytes=ns.max_request_bytes,
            default_temperature=ns.default_temperature,
            default_top_p=ns.default_top_p,
            default_top_k=ns.default_top_k,
            generation_config=ns.generation_config,
            tool_parser=ns.tool_parser,
            reasoning_parser=ns.reasoning_parser,
            distributed=ns.distributed,
            dtype=ns.dtype,
        )
        flags = ModelFlags(
            models_dir=ns.models_dir,
            models_file=ns.models_file,
            memory_budget=ns.memory_budget,
            wait_timeout_s=ns.model_wait_timeout,
            loras=tuple(ns.lora),
        )
        single = None
        if build is not None:
            single = build(options)
            if single is None:  # a rank other than 0: it applied rank 0's steps until stopped
                return build.follower_exit
        hub = build_hub(options, flags, single_state=single)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        log.error("%s", exc)
        return 2
    log.info("ready in %.1fs", time.monotonic() - started)
    _print_banner(ns, ", ".join(hub.registry.ids))

    import uvicorn

    from compat_serve.server.app import create_app
    from compat_serve.server.lifecycle import DrainingServer

    config = uvicorn.Config(
        create_app(hub),
        host=ns.host,
        port=ns.port,
        log_level=ns.log_level,
        # After the drain, responses still being written get this long to finish.
        timeout_graceful_shutdown=10,
    )
    DrainingServer(config, hub, ns.shutdown_timeout).run()
    if build is not None and build.lost_rank:
        return 3  # a rank of the group died or hung: a supervisor restarts them all
    return 0


def _model_preflight(ns: argparse.Namespace) -> str | None:
    """Why the model cannot be had, in one line, before mlx is imported (seconds) or None.

    A user who ran only `pip install compat-serve` has no embedded model; a hub id on a
    machine without network cannot be fetched. Both are told at once what to pass instead.
    """
    from compat_serve.models.errors import ModelLoadError
    from compat_serve.registry.adapters import parse_lora_flag

    if ns.lora and ns.distributed is not None:
        # The ranks apply rank 0's step plans, which carry no adapter rows.
        return "--lora is not served with --distributed: drop --lora"
    try:
        for text in ns.lora:  # a typo fails before the model loads
            parse_lora_flag(text)
    except ValueError as exc:
        return str(exc)
    try:
        if not ns.model and ns.models_dir is None and ns.models_file is None:
            if ns.distributed is None:  # --distributed refuses the embedded model itself
                from compat_serve.models.embedded import embedded_model_path

                embedded_model_path()
        elif ns.model:
            from compat_serve.models.hub import download_hub_model, looks_like_hub_id

            if looks_like_hub_id(ns.model):
                download_hub_model(ns.model)  # cached: the load reads the same snapshot
    except ModelLoadError as exc:
        return str(exc)
    return None


def _print_banner(ns: argparse.Namespace, model_name: str) -> None:
    host = "127.0.0.1" if ns.host in ("0.0.0.0", "::") else ns.host
    base = f"http://{host}:{ns.port}"
    key = ns.api_key or "unused"
    print(
        f"""
compat-serve {__version__} serving {model_name!r} at {base}

  OpenAI SDK:
    from openai import OpenAI
    client = OpenAI(base_url="{base}/v1", api_key="{key}")

  Anthropic SDK:
    from anthropic import Anthropic
    client = Anthropic(base_url="{base}", api_key="{key}")

  Claude Code:
    ANTHROPIC_BASE_URL={base} ANTHROPIC_API_KEY={key} claude

  Endpoints: POST /v1/messages, /v1/messages/count_tokens, /v1/chat/completions,
             /v1/completions; GET /v1/models, /health
  Dashboard: {base}/dashboard
""",
        flush=True,
    )
