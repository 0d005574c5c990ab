"""Serve the scripted model (tests/scripted_model.py) over HTTP, for real-CLI tests.

    python -m tests.e2e.scripted_serve --port P --template FILE --replies FILE.json

`--replies` holds `[[trigger, reply], ...]`: the first rule whose trigger text occurs in
the prompt gives the reply ("" matches every prompt).
"""

from __future__ import annotations

import argparse
import json
import logging

from compat_serve.models.blas import ensure_fast_blas


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--template", required=True)
    parser.add_argument("--replies", required=True)
    parser.add_argument("--context-length", type=int, default=8192)
    ns = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ensure_fast_blas()

    import uvicorn

    from compat_serve.bootstrap import ServeOptions, build_state
    from compat_serve.models.loader import load_model
    from compat_serve.server.app import create_app
    from tests.scripted_model import scripted_model

    with open(ns.template, encoding="utf-8") as f:
        template = f.read()
    with open(ns.replies, encoding="utf-8") as f:
        replies = [(trigger, reply) for trigger, reply in json.load(f)]
    loaded = scripted_model(load_model(None), template, replies, context_length=ns.context_length)
    state = build_state(ServeOptions(), loaded=loaded)
    uvicorn.run(create_app(state), host="127.0.0.1", port=ns.port, log_level="info")


if __name__ == "__main__":
    main()
