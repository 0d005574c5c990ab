"""One model over two local ranks (`--distributed`, issue #28) against one process.

Four servers on random models the size of SmolLM2-135M (hidden 512, 8 layers, 8 heads,
4 KV heads; its tokenizer): a one-rank llama and a two-rank tensor-parallel llama, and
a one-rank qwen2 and a two-rank pipeline qwen2 (mlx-lm's llama has no pipeline split).
The two ranks run on this machine over the ring backend on 127.0.0.1, so on this CPU the
figures show the overhead of splitting, never a speed-up: both ranks share the same
cores, and every layer (tensor) or every step (pipeline) waits on a TCP round trip. The
one-rank servers also use the CPU fast paths (fused decode kernels) that a sharded model
cannot.

Per round, alternating the servers: prefill tok/s (one ~400-token prompt, one output
token: prompt tokens / time to first token), decode tok/s at 1 stream and at 8 streams
(short prompts, 48 tokens each; aggregate tokens after the first / wall time), and, for
the two-rank servers, the milliseconds rank 0 spends per step plan sending it (the plan's
collectives, with the wait for the follower to join them). Prints medians over the rounds
with min-max.

Run: `.venv/bin/python benches/distributed.py [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from _servers import (
    BIN,
    CACHE,
    Server,
    _spawn,
    _wait_ready,
    converted_model_dir,
    free_port,
    log,
    make_client,
    stream_chat,
)

SIZE = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
ARGS = ["--no-prefix-cache", "--log-level", "warning"]


def model_dir(family: str) -> Path:
    """A random `family` model of SIZE with SmolLM2's tokenizer (cached)."""
    out = CACHE / f"distributed-{family}"
    if (out / "model.safetensors").exists():
        return out
    tokenizer_dir = converted_model_dir()
    config = {**json.loads((tokenizer_dir / "config.json").read_text()), **SIZE}
    config["model_type"] = family
    config.pop("architectures", None)
    tmp = Path(tempfile.mkdtemp(prefix=f"distributed-{family}.", dir=CACHE))
    code = (
        "import json, sys, importlib, mlx.core as mx\n"
        "from mlx_lm.utils import save_model, save_config\n"
        "config = json.loads(sys.argv[1])\n"
        "module = importlib.import_module('mlx_lm.models.' + config['model_type'])\n"
        "mx.random.seed(0)\n"
        "model = module.Model(module.ModelArgs.from_dict(config))\n"
        "mx.eval(model.parameters())\n"
        "save_model(sys.argv[2], model)\n"
        "save_config(config, sys.argv[2] + '/config.json')\n"
    )
    subprocess.run([sys.executable, "-c", code, json.dumps(config), str(tmp)], check=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


class Group:
    """A one-rank server, or rank 0 and its followers (over a local ring)."""

    def __init__(self, name: str, path: Path, mode: str | None, log_dir: Path) -> None:
        self.name = name
        port = free_port()
        cmd = [str(BIN / "compat-serve"), "--model", str(path), "--port", str(port), *ARGS]
        if mode is None:
            self.servers = [_spawn(name, cmd, log_dir, port)]
        else:
            hostfile = log_dir / f"{name}-hosts.json"
            hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(2)]))
            self.servers = []
            for rank in (1, 0):
                os.environ.update(MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
                server = _spawn(f"{name}-rank{rank}", [*cmd, "--distributed", mode], log_dir, port)
                self.servers.insert(0, server)
            os.environ.pop("MLX_RANK")
            os.environ.pop("MLX_HOSTFILE")
        _wait_ready(self.servers[0], "/health", 300)
        self.base_url = self.servers[0].base_url

    def plan_ms(self) -> float | None:
        status = httpx.get(f"{self.base_url}/v1/status", timeout=10).json()
        distributed = status.get("distributed")
        return None if distributed is None else float(distributed["plan_ms_per_plan"])

    def stop(self) -> None:
        for server in self.servers:  # rank 0 first: it stops the follower
            Server.stop(server)


def body(content: str, max_tokens: int) -> dict[str, object]:
    # Greedy: the one- and two-rank servers then produce the same tokens.
    return {"model": "m", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0}  # fmt: skip


def measure(group: Group) -> dict[str, float]:
    client = make_client()
    long_prompt = " ".join(f"item{k} is stored under key{k * 7}" for k in range(60))
    prefill = stream_chat(client, group.base_url, body(long_prompt, 1))
    out = {"prefill": prefill.prompt_tokens / prefill.ttft}
    for streams in (1, 8):
        with ThreadPoolExecutor(streams) as pool:
            results = list(
                pool.map(
                    lambda i: stream_chat(client, group.base_url, body(f"Story {i}:", 48)),
                    range(streams),
                )
            )
        first = min(r.first_token or r.done for r in results)
        done = max(r.done for r in results)
        out[f"decode{streams}"] = sum(r.completion_tokens - 1 for r in results) / (done - first)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    log_dir = Path(tempfile.mkdtemp(prefix="bench-distributed."))
    layouts = [
        ("llama 1 rank", "llama", None),
        ("llama TP 2 ranks", "llama", "tensor"),
        ("qwen2 1 rank", "qwen2", None),
        ("qwen2 PP 2 ranks", "qwen2", "pipeline"),
    ]
    groups = []
    try:
        for name, family, mode in layouts:
            log(f"starting {name} ...")
            groups.append(Group(name, model_dir(family), mode, log_dir))
        samples: dict[str, dict[str, list[float]]] = {g.name: {} for g in groups}
        for round_ in range(rounds):
            for group in groups if round_ % 2 == 0 else reversed(groups):
                log(f"round {round_ + 1}: {group.name}")
                for key, value in measure(group).items():
                    samples[group.name].setdefault(key, []).append(value)
        print(f"{rounds} rounds, medians (min-max); ranks share this machine's CPU cores")
        print(f"{'server':<18} {'prefill tok/s':>20} {'decode 1 tok/s':>20} "
              f"{'decode 8 tok/s':>20} {'plan ms/step':>12}")  # fmt: skip
        for group in groups:
            cells = []
            for key in ("prefill", "decode1", "decode8"):
                values = samples[group.name][key]
                cells.append(
                    f"{statistics.median(values):7.1f} ({min(values):.1f}-{max(values):.1f})"
                )
            plan = group.plan_ms()
            plan_cell = "-" if plan is None else f"{plan:.3f}"
            print(f"{group.name:<18} {cells[0]:>20} {cells[1]:>20} {cells[2]:>20} {plan_cell:>12}")
    finally:
        for group in groups:
            group.stop()


if __name__ == "__main__":
    main()
