"""LoRA adapters per request over HTTP (#38), on one real server: a tiny random llama
with two random rank-8 adapters, one per format (mlx-lm's, via `--lora`, and PEFT's),
big enough to change its greedy tokens. The server is greedy by its own default
(`--default-temperature 0`), so the bodies stay as the SDKs send them.

What an adapter did is read from usage: its KV blocks are salted with its fingerprint,
so a prompt reads its full prefix from cache only under the adapter that stored it; the
cache's own keys (RAM and disk) are inspected too, and again after a restart from the
disk tier. Those checks send raw completions whose first words differ per test: a chat
template's header (`<|im_start|>system`) is a prefix every chat prompt shares, and the
cache reads it (token-granular) for any earlier prompt of the same adapter."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from compat_serve.bootstrap import ServeOptions, build_state
from compat_serve.models.types import LoadedModel
from compat_serve.registry.adapters import AdapterEntry
from compat_serve.registry.hub import ModelHub
from compat_serve.serve_models import ModelFlags, build_hub
from compat_serve.server.app import create_app
from tests.conftest import USERS_PATH, RunningServer, run_app
from tests.http.sdk_clients import claude, oai
from tests.python.lora_files import (
    MLX_KEYS,
    PEFT_MODULES,
    PEFT_TARGETS,
    random_pairs,
    write_mlx_adapter,
    write_peft_adapter,
)
from tests.tiny_models import quantize_tiny, tiny_model, write_model_dir

MAX_TOKENS = 12


@dataclass
class Lora:
    model: LoadedModel
    commits: Path  # mlx-lm format
    style: Path  # PEFT format
    extra: Path  # loaded over HTTP
    cache_dir: Path


@pytest.fixture(scope="module")
def lora(embedded_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Lora:
    # A model of its own: adapters wrap its linears (adapters/bank.py).
    tiny = tiny_model("llama", embedded_model, seed=3)
    model = quantize_tiny(tiny) if USERS_PATH else tiny
    root = tmp_path_factory.mktemp("lora")
    layers = len(model.model.layers)
    return Lora(
        model,
        write_mlx_adapter(
            root / "commits", random_pairs(model.model, MLX_KEYS, 1), scale=4.0, layers=layers
        ),
        write_peft_adapter(
            root / "style",
            random_pairs(model.model, PEFT_MODULES, 2),
            alpha=32.0,
            targets=PEFT_TARGETS,
        ),
        write_mlx_adapter(
            root / "extra", random_pairs(model.model, MLX_KEYS, 3), scale=4.0, layers=layers
        ),
        root / "cache",
    )


def _start(lora: Lora) -> RunningServer:
    # Per-key salting on, as a shared server would run: the SDK clients present "x".
    options = ServeOptions(
        default_temperature=0.0, cache_dir=str(lora.cache_dir), cache_salt_per_key=True
    )
    state = build_state(options, loaded=lora.model)
    flags = ModelFlags(loras=(f"commits={lora.commits}", f"style={lora.style}"))
    hub = build_hub(options, flags, single_state=state)
    # The alias a --models file would give it (its parsing: test_lora_routing.py).
    base = hub.registry.default.id
    hub.registry.adapters.add(
        base, AdapterEntry("commits", str(lora.commits.resolve()), ("commit-writer",))
    )
    return run_app(create_app(hub), hub)


@pytest.fixture(scope="module")
def server(lora: Lora) -> Iterator[RunningServer]:
    running = _start(lora)
    yield running
    running.stop()


def _hub(server: RunningServer) -> ModelHub:
    hub = server.state
    assert isinstance(hub, ModelHub)
    return hub


def _base(server: RunningServer) -> str:
    return _hub(server).registry.default.id


def _message(
    server: RunningServer, model: str, text: str, system: str = "You review patches."
) -> anthropic.types.Message:
    """A Messages request as the SDK sends it. Each test's own `system` (first in the
    prompt) keeps its blocks from matching another test's."""
    return claude(server).messages.create(
        model=model,
        max_tokens=MAX_TOKENS,
        system=system,
        messages=[{"role": "user", "content": text}],
    )


def _read(server: RunningServer, model: str, prompt: str, key: str = "x") -> tuple[int, int]:
    """A raw completion of `prompt` under `model`, sent with API key `key`: (tokens read
    from cache, prompt tokens)."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)
    completion = client.completions.create(model=model, prompt=prompt, max_tokens=4)
    assert completion.model == model
    usage = completion.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return usage.prompt_tokens_details.cached_tokens or 0, usage.prompt_tokens


def _block_keys(server: RunningServer) -> set[bytes]:
    """The chained hashes of the blocks the RAM tier holds."""
    state = _hub(server).front_state()
    assert state is not None and state.engine.prefix is not None
    return set(state.engine.prefix._by_hash)


def _disk_keys(lora: Lora) -> set[str]:
    """The block keys of the disk tier's files (`<parent id>_<key>.kv`)."""
    return {p.stem.partition("_")[2] for p in lora.cache_dir.glob("*/*.kv")}


def test_an_adapter_changes_the_output_on_both_apis(server: RunningServer) -> None:
    base = _base(server)
    prompt = "Write a commit message for a fix to the parser."
    texts = {}
    for model in (base, "commits", "style"):
        message = _message(server, model, prompt)
        assert message.model == model  # the name asked for is echoed
        texts[model] = "".join(b.text for b in message.content if b.type == "text")
        assert message.usage.output_tokens > 0
    assert len(set(texts.values())) == 3, texts

    chat = {}
    for model in (base, f"{base}:commits"):
        completion = oai(server).chat.completions.create(
            model=model,
            max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": "Name three colours of the rainbow."}],
        )
        assert completion.model == model
        chat[model] = completion.choices[0].message.content
    assert chat[base] != chat[f"{base}:commits"], chat


def test_ollama_and_responses_requests_pass_the_adapter(server: RunningServer) -> None:
    base, url = _base(server), server.base_url
    said = {}
    for model in (base, "style"):
        chat = httpx.post(
            f"{url}/api/chat",
            json={
                "model": model,
                "messages": [{"role": "user", "content": "List two fruits."}],
                "options": {"num_predict": MAX_TOKENS},
                "stream": False,
            },
            timeout=60,
        ).json()
        assert chat["model"] == model
        response = httpx.post(
            f"{url}/v1/responses",
            json={"model": model, "input": "List two fruits.", "max_output_tokens": MAX_TOKENS},
            timeout=60,
        ).json()
        assert response["model"] == model
        said[model] = (chat["message"]["content"], response["output"][-1]["content"][0]["text"])
    assert said[base][0] != said["style"][0], said
    assert said[base][1] != said["style"][1], said


def test_the_three_naming_forms_pick_the_same_adapter(server: RunningServer) -> None:
    base = _base(server)
    prompt = "Naming: summarise the change to the tokenizer in one line, in plain words."
    assert _read(server, f"{base}:commits", prompt)[0] == 0
    for name in ("commits", "commit-writer", "commits:latest"):
        # A full read of the blocks `base:commits` stored: the same adapter's salt.
        read, total = _read(server, name, prompt)
        assert read == total - 1, (name, read, total)  # the last token is computed
    # The base and the other adapter read none of it.
    assert _read(server, "style", prompt)[0] == 0
    assert _read(server, base, prompt)[0] == 0


def test_the_adapter_and_the_api_key_both_salt_the_cache(server: RunningServer) -> None:
    base = _base(server)
    prompt = "Keys: two users of one adapter keep their cached prompts apart as well."
    assert _read(server, "commits", prompt, key="alice")[0] == 0
    assert _read(server, "commits", prompt, key="bob")[0] == 0
    assert _read(server, base, prompt, key="alice")[0] == 0
    read, total = _read(server, "commits", prompt, key="alice")
    assert read == total - 1


def test_an_unknown_adapter_is_model_not_found_on_both_apis(server: RunningServer) -> None:
    base = _base(server)
    with pytest.raises(anthropic.NotFoundError) as claude_error:
        _message(server, f"{base}:nope", "hi")
    body: Any = claude_error.value.body
    assert body["type"] == "error"
    assert body["error"]["type"] == "not_found_error"
    assert f"model '{base}' has no adapter 'nope'" in body["error"]["message"]
    assert "'commits', 'style'" in body["error"]["message"]
    with pytest.raises(openai.NotFoundError) as oai_error:
        oai(server).chat.completions.create(
            model=f"{base}:nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert oai_error.value.code == "model_not_found"
    assert oai_error.value.param == "model"
    response = httpx.get(f"{server.base_url}/v1/models/{base}:nope")
    assert response.status_code == 404


def test_adapters_are_listed_with_their_base(server: RunningServer, lora: Lora) -> None:
    base = _base(server)
    cards = {c["id"]: c for c in httpx.get(f"{server.base_url}/v1/models").json()["data"]}
    assert cards[base]["parent"] is None
    assert cards["commits"]["parent"] == base
    assert cards["commits"]["root"] == str(lora.commits.resolve())
    assert cards["commits"]["aliases"] == ["commit-writer"]
    assert cards["style"]["parent"] == base
    assert cards["style"]["state"] == "loaded"
    one = httpx.get(f"{server.base_url}/v1/models/{base}:style").json()
    assert (one["id"], one["parent"]) == ("style", base)

    tags = {t["name"]: t for t in httpx.get(f"{server.base_url}/api/tags").json()["models"]}
    assert tags["commits:latest"]["details"]["parent_model"] == f"{base}:latest"
    assert tags["commits:latest"]["size"] > 0  # the adapter's files
    assert tags[f"{base}:latest"]["details"]["parent_model"] == ""

    (model,) = httpx.get(f"{server.base_url}/v1/dashboard").json()["models"]
    assert [a["name"] for a in model["adapters"]] == ["commits", "style"]


def test_adapters_load_and_unload_over_http(server: RunningServer, lora: Lora) -> None:
    url, base = server.base_url, _base(server)
    loaded = httpx.post(
        f"{url}/models/load", json={"model": f"{base}:extra", "path": str(lora.extra)}
    )
    assert loaded.json() == {"success": True}, loaded.text
    assert "extra" in {c["id"] for c in httpx.get(f"{url}/v1/models").json()["data"]}
    prompt = "Loading: which file changed in the last commit, and why?"
    assert _read(server, "extra", prompt)[0] == 0
    read, total = _read(server, f"{base}:extra", prompt)
    assert read == total - 1
    assert _read(server, base, prompt)[0] == 0

    unloaded = httpx.post(f"{url}/models/unload", json={"model": "extra"})
    assert unloaded.json() == {"success": True}, unloaded.text
    assert "extra" not in {c["id"] for c in httpx.get(f"{url}/v1/models").json()["data"]}
    assert "extra" not in (_hub(server).front_state().engine.adapter_names())  # type: ignore[union-attr]
    gone = httpx.post(
        f"{url}/v1/messages",
        json={
            "model": f"{base}:extra",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "x"}],
        },
    )
    assert gone.status_code == 404
    # The base stays resident.
    assert _hub(server).slots[base].status == "loaded"

    # vLLM's routes do the same.
    vllm = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": str(lora.extra)}
    )
    assert vllm.status_code == 200 and "extra" in vllm.text
    assert _message(server, f"{base}:extra", "x").model == f"{base}:extra"
    vllm = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "extra"})
    assert vllm.status_code == 200, vllm.text


def test_bad_adapter_loads_and_unloads_are_4xx(server: RunningServer, lora: Lora) -> None:
    url, base = server.base_url, _base(server)
    broken = lora.cache_dir.parent / "broken"
    broken.mkdir(exist_ok=True)
    (broken / "adapter_config.json").write_text(
        '{"fine_tune_type": "lora", "lora_parameters": {"rank": 8, "scale": 1.0}}'
    )
    cases = [
        ("/models/load", {"model": "x", "path": str(lora.cache_dir)}, 400, "is not an adapter"),
        ("/models/load", {"model": "x", "path": 3}, 400, "path: must be"),
        ("/models/load", {"model": "x", "path": str(broken)}, 400, "adapters.safetensors"),
        ("/models/load", {"model": "commits", "path": str(lora.extra)}, 400, "already an adapter"),
        ("/models/load", {"model": base, "path": str(lora.extra)}, 400, "already the id"),
        ("/models/load", {"model": "nobase:x", "path": str(lora.extra)}, 404, "not found"),
        ("/models/unload", {"model": f"{base}:nope"}, 404, "has no adapter 'nope'"),
        ("/v1/unload_lora_adapter", {"lora_name": base}, 400, "is a model, not an adapter"),
        ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "path: must be"),
    ]
    for path, body, status, message in cases:
        response = httpx.post(f"{url}{path}", json=body)
        assert response.status_code == status, (path, body, response.text)
        assert message in response.json()["error"]["message"], (path, body, response.text)
    # Loading the same adapter again is a no-op.
    again = httpx.post(f"{url}/models/load", json={"model": "commits", "path": str(lora.commits)})
    assert again.json() == {"success": True}


def test_a_models_file_serves_adapters_on_a_model_loaded_on_demand(
    embedded_model: LoadedModel, lora: Lora, tmp_path: Path
) -> None:
    # The same family and shapes as the adapters' model; loaded on its first request,
    # its adapters added on the engine host's thread (serve_models.load_with_adapters).
    write_model_dir(tmp_path / "coder", "llama", embedded_model, seed=3)
    models = tmp_path / "models.yaml"
    models.write_text(
        "models:\n"
        "  - id: coder\n"
        "    path: coder\n"
        "    adapters:\n"
        f"      - {{name: commits, path: {lora.commits}, aliases: [commit-writer]}}\n"
        f"      - style={lora.style}\n"
    )
    hub = build_hub(ServeOptions(default_temperature=0.0), ModelFlags(models_file=str(models)))
    running = run_app(create_app(hub), hub)
    try:
        assert hub.slots["coder"].status == "unloaded"
        prompt = "On demand: the model loads with its adapters on the first request."
        assert _read(running, "commit-writer", prompt)[0] == 0
        state = hub.slots["coder"].state
        assert state is not None and state.engine.adapter_names() == ["commits", "style"]
        read, total = _read(running, "coder:commits", prompt)
        assert read == total - 1
        assert _read(running, "style", prompt)[0] == 0
        assert _read(running, "coder", prompt)[0] == 0
    finally:
        running.stop()


def test_cache_isolation_on_ram_and_disk_and_after_a_restart(
    server: RunningServer, lora: Lora
) -> None:
    base = _base(server)
    prompt = "Isolation: explain why two adapters never share a cached block of this text."
    new_ram: dict[str, set[bytes]] = {}
    new_disk: dict[str, set[str]] = {}
    for name in ("commits", "style", base):
        ram, disk = _block_keys(server), _disk_keys(lora)
        assert _read(server, name, prompt)[0] == 0, name
        new_ram[name] = _block_keys(server) - ram
        new_disk[name] = _wait_for_disk(lora, disk)
    read, total = _read(server, "commits", prompt)
    assert read == total - 1
    blocks = total // 16  # the prompt's full blocks (--block-size 16)
    for keys in (new_ram, new_disk):
        assert all(len(k) >= blocks > 0 for k in keys.values()), keys  # type: ignore[attr-defined]
        a, b, c = keys.values()
        assert not (a & b) and not (a & c) and not (b & c)

    # A prompt only `style` has seen, then a restart: the disk tier serves it to `style`
    # alone.
    only_style = "Restart: a second prompt that only one adapter has seen before it."
    assert _read(server, "style", only_style)[0] == 0
    _wait_for_disk(lora, _disk_keys(lora) - new_disk["style"], settle=True)
    server.stop()
    restarted = _start(lora)
    try:
        assert _read(restarted, base, only_style)[0] == 0
        assert _read(restarted, "commits", only_style)[0] == 0
        read, total = _read(restarted, "style", only_style)
        assert read == total - 1
        read, total = _read(restarted, "commits", prompt)  # its own blocks, from disk
        assert read == total - 1
    finally:
        restarted.stop()


def _wait_for_disk(lora: Lora, before: set[str], settle: bool = False) -> set[str]:
    """The keys the disk tier's writer thread adds after `before` (written off the engine
    thread: polled until they stop growing)."""
    import time

    deadline, seen, stable = time.monotonic() + 10, set[str](), 0
    while time.monotonic() < deadline:
        now = _disk_keys(lora) - before
        stable = stable + 1 if now == seen and now else 0
        if stable >= 3:
            return now
        seen = now
        time.sleep(0.05)
    if settle:
        return seen
    raise AssertionError("the disk tier wrote nothing")
