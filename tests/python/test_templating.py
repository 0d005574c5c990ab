"""Unit tests of compat_serve.templating (the Rust chat-template renderer)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any

import pytest

from compat_serve.templating import ChatTemplate, TemplateError

USER = [{"role": "user", "content": "hi"}]


def render(source: str, messages: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
    return ChatTemplate(source).render(messages if messages is not None else USER, **kwargs)


# --- errors -------------------------------------------------------------------


def test_raise_exception_message_is_verbatim() -> None:
    source = "{{ raise_exception('Conversation roles must alternate user/assistant/...') }}"
    with pytest.raises(TemplateError) as info:
        render(source)
    assert str(info.value) == "Conversation roles must alternate user/assistant/..."


def test_raise_exception_inside_macro_and_loop() -> None:
    source = (
        "{% macro check(m) %}{% if m.role == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}{% endmacro %}"
        "{% for m in messages %}{{ check(m) }}{% endfor %}"
    )
    assert render(source) == ""
    with pytest.raises(TemplateError, match=r"^System role not supported$"):
        render(source, [{"role": "system", "content": "x"}])


@pytest.mark.parametrize(
    "source",
    ["{% if %}", "{% for x in %}{% endfor %}", "{{ unclosed", "{% endif %}", "{% unknowntag %}"],
)
def test_syntax_errors_raise_template_error(source: str) -> None:
    with pytest.raises(TemplateError):
        ChatTemplate(source)


def test_runtime_errors_raise_template_error() -> None:
    with pytest.raises(TemplateError):
        render("{{ messages[0].content + 1 }}")
    with pytest.raises(TemplateError, match="not iterable"):
        render("{% for t in tools %}{{ t }}{% endfor %}")  # tools is None, as in jinja2
    with pytest.raises(TemplateError, match="pop from empty list"):
        render("{% set q = [] %}{{ q.pop() }}")  # as in jinja2's SandboxedEnvironment
    with pytest.raises(TemplateError, match="'tuple' object has no method 'append'"):
        render("{% set q = (1,) %}{{ q.append(1) }}")


def test_lists_and_dicts_change_in_place() -> None:
    # jinja2's SandboxedEnvironment renders this (transformers' immutable one refuses).
    source = "{% set q = namespace(ids=[]) %}{% set _ = q.ids.append(messages[0]) %}{{ q.ids }}"
    assert render(source) == "[{'role': 'user', 'content': 'hi'}]"


def test_template_error_is_an_exception() -> None:
    assert issubclass(TemplateError, Exception)
    assert TemplateError.__module__ == "compat_serve._native"


def test_non_json_input_rejected() -> None:
    with pytest.raises(ValueError, match="NaN"):
        render("{{ messages }}", [{"role": "user", "content": float("nan")}])


# --- tojson -------------------------------------------------------------------

NESTED: dict[str, Any] = {
    "zeta": 1,
    "alpha": {"é": "ü 😀 <b>&'", "list": [1, 2.5, None, True, {"z": [], "a": {}}]},
    "mid": 1e-7,
    "big": 1e20,
}


@pytest.mark.parametrize(
    ("call", "kwargs"),
    [
        ("tojson", {}),
        ("tojson(indent=2)", {"indent": 2}),
        ("tojson(indent=0)", {"indent": 0}),
        ("tojson(indent='\\t')", {"indent": "\t"}),
        ("tojson(sort_keys=true)", {"sort_keys": True}),
        ("tojson(separators=(',', ':'))", {"separators": (",", ":")}),
        ("tojson(ensure_ascii=true)", {"ensure_ascii": True}),
        ("tojson(indent=4, separators=(', ', ' = '))", {"indent": 4, "separators": (", ", " = ")}),
        ("tojson(true, 2)", {"ensure_ascii": True, "indent": 2}),
    ],
)
def test_tojson_matches_json_dumps(call: str, kwargs: dict[str, Any]) -> None:
    expected = json.dumps(NESTED, **{"ensure_ascii": False, **kwargs})
    assert render("{{ data|" + call + " }}", data=NESTED) == expected


def test_tojson_keeps_insertion_order_of_messages() -> None:
    message = {"role": "user", "z": 1, "content": "x", "a": 2}
    assert render("{{ messages[0]|tojson }}", [message]) == json.dumps(message)


def test_tojson_of_undefined_raises() -> None:
    with pytest.raises(TemplateError, match="not JSON serializable"):
        render("{{ missing|tojson }}")


# --- printing like Python's str() ---------------------------------------------

PRINTED: list[Any] = [
    True,
    False,
    None,
    0,
    -7,
    1.0,
    0.1,
    1e-05,
    1e16,
    123456.789,
    "plain",
    ["x", 1, None, True, 2.5],
    {"a": 1, "b": [True, None], "c": {"d": "it's"}},
    {"quotes": "say \"hi\" and 'bye'", "ctrl": "tab\there\nnl\x07", "uni": "é👨\u200d👩\xa0"},
    [],
    {},
]


@pytest.mark.parametrize("value", PRINTED, ids=[repr(v)[:30] for v in PRINTED])
def test_printing_matches_python_str(value: Any) -> None:
    assert render("{{ v }}", v=value) == str(value)
    assert render("{{ v|string }}", v=value) == str(value)
    assert render("{{ 'x' ~ v ~ 'y' }}", v=value) == f"x{value}y"


def test_join_uses_python_str() -> None:
    assert render("{{ v|join(', ') }}", v=[1, None, 2.5e-8, True]) == "1, None, 2.5e-08, True"


def test_undefined_prints_empty() -> None:
    assert render("[{{ missing }}][{{ missing|string }}][{{ missing|length }}]") == "[][][0]"


# --- Python methods and jinja2 filters ----------------------------------------


def test_python_string_and_dict_methods() -> None:
    source = (
        "{{ s.strip() }}|{{ s.split() }}|{{ s.lstrip().startswith('a') }}|"
        "{{ d.get('k') }}|{{ d.get('x', 'dflt') }}|{{ d.items()|list }}|"
        "{{ 'a,b,,c'.split(',', 2) }}|{{ '\x1fx\x1f'.strip() }}"
    )
    out = render(source, s="  a b\tc  ", d={"k": "v"})
    assert out == "a b\tc|['a', 'b', 'c']|True|v|dflt|[('k', 'v')]|['a', 'b', ',c']|x"


def test_indent_filter_like_jinja2() -> None:
    assert render("{{ '{\\n'|indent(4, first=true) }}") == "    {\n"
    assert render("{{ 'a\\nb\\n\\nc'|indent(2) }}") == "a\n  b\n\n  c"


def test_markup_addition_escapes_like_jinja2() -> None:
    source = "{{ \"'\"|safe + name + \"'\"|safe }}|{{ name|e }}|{{ '<'|safe ~ name }}"
    assert render(source, name='a<b>&"') == "'a&lt;b&gt;&amp;&#34;'|a&lt;b&gt;&amp;&#34;|<a<b>&\""


def test_generation_tag_renders_body() -> None:
    source = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    assert render(source) == "hi"


def test_whitespace_control_like_transformers() -> None:
    source = "{% for m in messages %}\n    {{ m.content }}\n{% endfor %}\n"
    assert render(source, USER * 2) == "    hi\n    hi\n"


# --- context ------------------------------------------------------------------


def test_context_defaults_like_transformers() -> None:
    source = (
        "{{ tools is none }} {{ documents is none }} {{ bos_token is defined }} "
        "{{ eos_token }} {{ add_generation_prompt }} {{ enable_thinking }}"
    )
    out = ChatTemplate(source).render(USER, eos_token="</s>", enable_thinking=False)
    assert out == "True True False </s> True False"
    no_prompt = ChatTemplate("{{ add_generation_prompt }}").render(
        USER, add_generation_prompt=False
    )
    assert no_prompt == "False"


def test_kwargs_override_documents_and_reach_template() -> None:
    source = "{{ documents[0].title }} {{ custom.nested[1] }}"
    out = render(source, documents=[{"title": "T", "text": "x"}], custom={"nested": (1, 2)})
    assert out == "T 2"


def test_objects_are_reduced_like_transformers() -> None:
    class Model:
        def model_dump(self) -> dict[str, Any]:
            return {"role": "user", "content": "dumped"}

    class Opaque:
        pass

    out = render("{{ messages[0].content }} {{ thing }}", [Model()], thing=Opaque())  # type: ignore[list-item]
    assert out == "dumped <Opaque>"


def test_strftime_now_can_be_pinned() -> None:
    template = ChatTemplate(
        "{{ strftime_now('%d %b %Y %H:%M') }}", now=datetime(2024, 2, 29, 13, 5)
    )
    assert template.render(USER) == "29 Feb 2024 13:05"
    live = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}").render(USER)
    assert live in {datetime.now().strftime("%Y-%m-%d"), time.strftime("%Y-%m-%d")}


def test_source_and_repr() -> None:
    template = ChatTemplate("{{ 1 }}")
    assert template.source == "{{ 1 }}"
    assert "7 bytes" in repr(template)


# --- threads ------------------------------------------------------------------


def test_concurrent_renders_from_threads() -> None:
    template = ChatTemplate(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    )

    def job(i: int) -> str:
        messages = [{"role": "user", "content": f"message {i}-{j}"} for j in range(50)]
        return template.render(messages)

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(job, range(200)))
    for i, out in enumerate(results):
        assert out.count("<user>") == 50
        assert f"message {i}-49" in out


def test_render_releases_the_gil() -> None:
    # A render of pure Rust work; while it runs, a Python thread must keep running.
    template = ChatTemplate(
        "{% for i in range(n) %}{% for j in range(n) %}{% endfor %}{% endfor %}ok"
    )
    n = 300
    start = time.perf_counter()
    template.render(USER, n=n)
    single = time.perf_counter() - start
    n = min(3000, int(n * (0.4 / max(single, 1e-4)) ** 0.5) + 1)  # aim for ~0.4 s

    done = threading.Event()
    gaps: list[float] = []

    def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        start = time.perf_counter()
        assert template.render(USER, n=n) == "ok"
        elapsed = time.perf_counter() - start
    finally:
        done.set()
        thread.join()
    assert elapsed > 0.1
    # Holding the GIL would stall the ticker for the whole render.
    assert max(gaps) < elapsed / 2
