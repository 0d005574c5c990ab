"""transformers' chat-template environment, rebuilt for tests as the reference renderer.

Mirrors `transformers.utils.chat_template_utils._cached_compile_jinja_template`:
a sandbox with trim_blocks, lstrip_blocks, loopcontrols + the `{% generation %}`
tag, HF `tojson`, `raise_exception`, `strftime_now`, `dict`, and a namespace that
rejects underscore names. Our Rust renderer must match it.

One difference on purpose: the reference is jinja2's `SandboxedEnvironment`, which
lets a template change lists and dicts (`ns.ids.append(x)`, as both Kimi K2
templates' tool-call queue does, and as llama.cpp renders them), where transformers
uses `ImmutableSandboxedEnvironment`, which refuses it. `immutable=True` rebuilds
transformers' exact environment (to check this rebuild against transformers).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's API

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _TemplateDict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"underscore attribute {name!r} on a namespace")


def _now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=64)
def compile_template(
    source: str, strftime_now: Any = _now, *, immutable: bool = False
) -> jinja2.Template:
    sandbox = ImmutableSandboxedEnvironment if immutable else SandboxedEnvironment
    env = sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def render_like_transformers(source: str, messages: list[dict[str, Any]], **context: Any) -> str:
    return compile_template(source).render(messages=messages, **context)
