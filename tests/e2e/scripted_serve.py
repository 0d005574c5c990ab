"""Serve the scripted model (tests/scripted_model.py) over HTTP, for real-CLI tests.

    python -m tests.e2e.scripted_serve --port P --template FILE --replies FILE.json

`--replies` holds `[[trigger, reply], ...]`: the first rule whose trigger text occurs in
the prompt gives the reply ("" matches every prompt). `--capture DIR` writes each POST
body the server receives to DIR/NNN.json (what the CLI under test really sent).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
from pathlib import Path
from typing import Any

from compat_serve.models.blas import ensure_fast_blas


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--template", required=True)
    parser.add_argument("--replies", required=True)
    parser.add_argument("--context-length", type=int, default=8192)
    parser.add_argument("--capture", help="directory for the received POST bodies")
    ns = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ensure_fast_blas()

    import uvicorn

    from compat_serve.bootstrap import ServeOptions, build_state
    from compat_serve.server.app import create_app
    from tests.scripted_model import embedded_tokenizer_only, scripted_model

    with open(ns.template, encoding="utf-8") as f:
        template = f.read()
    with open(ns.replies, encoding="utf-8") as f:
        replies = [(trigger, reply) for trigger, reply in json.load(f)]
    # The embedded model's tokenizer alone: the scripted model needs none of its weights.
    base = embedded_tokenizer_only()
    loaded = scripted_model(base, template, replies, context_length=ns.context_length)
    state = build_state(ServeOptions(), loaded=loaded)
    app: Any = create_app(state)
    if ns.capture:
        app = _capturing(app, Path(ns.capture))
    uvicorn.run(app, host="127.0.0.1", port=ns.port, log_level="info")


def _capturing(app: Any, directory: Path) -> Any:
    """ASGI wrapper: saves every POST body, then replays it to the app unchanged."""
    directory.mkdir(parents=True, exist_ok=True)
    counter = itertools.count()

    async def wrapper(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        record = {"path": scope["path"], "body": json.loads(body or b"null")}
        (directory / f"{next(counter):03d}.json").write_text(json.dumps(record))
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await app(scope, replay, send)

    return wrapper


if __name__ == "__main__":
    main()
