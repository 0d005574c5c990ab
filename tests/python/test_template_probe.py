"""Template probing (inline-system policy, alternation) and the normalization rules."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from compat_serve.chat.normalize import fold_inline_system, merge_same_roles, normalize_messages
from compat_serve.chat.probe import probe_template
from compat_serve.templating import ChatTemplate
from tests.shared_data import manifest_rows, templates_dir

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

ROWS = manifest_rows()


def msg(role: str, content: str) -> dict[str, Any]:
    return {"role": role, "content": content}


def renderer(source: str) -> Any:
    template = ChatTemplate(source)

    def render(messages: list[dict[str, Any]], gen: bool) -> str:
        return template.render(
            messages, add_generation_prompt=gen, bos_token="<s>", eos_token="</s>"
        )

    return render


@pytest.mark.parametrize("row", ROWS, ids=[r["file"] for r in ROWS])
def test_probe_matches_manifest(row: dict[str, str]) -> None:
    traits = probe_template(renderer((templates_dir() / row["file"]).read_text(encoding="utf-8")))
    expected = "preserve" if row["system_inline_probe_c"] == "rendered in place" else "fold"
    assert traits.inline_system == expected, traits.inline_system_reason


TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up.",
        "parameters": {
            "type": "object",
            "properties": {"q": {"type": "string", "description": "the word"}},
            "required": ["q"],
        },
    },
}
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
# Context some templates need to render at all (see MANIFEST.tsv extra_context_vars).
RENDER_CONTEXTS: list[dict[str, Any]] = [
    SPECIAL,
    {**SPECIAL, "tools": [TOOL]},
    {**SPECIAL, "tools": [TOOL], "functions": "[]", "datetime": "2026-11-21"},
]


def render_somehow(source: str, histories: list[list[dict[str, Any]]]) -> tuple[Any, list[Any]]:
    """The first (context, history) the template renders; fails when there is none."""
    template = ChatTemplate(source)
    errors = []
    for history in histories:
        for context in RENDER_CONTEXTS:
            try:
                template.render(history, add_generation_prompt=False, **context)
            except Exception as exc:
                errors.append(exc)
                continue

            def render(messages: list[dict[str, Any]], gen: bool, ctx: Any = context) -> str:
                return template.render(messages, add_generation_prompt=gen, **ctx)

            return render, history
    pytest.fail(f"template renders no plain conversation: {errors[-1]}")


@pytest.mark.parametrize("row", ROWS, ids=[r["file"] for r in ROWS])
def test_fold_never_changes_tokens_before_the_inline_message(
    row: dict[str, str], embedded_model: LoadedModel
) -> None:
    source = (templates_dir() / row["file"]).read_text(encoding="utf-8")
    question = msg("user", "Question one?")
    render, history = render_somehow(source, [[msg("system", "Be brief."), question], [question]])
    before = render(history, False)
    folded = normalize_messages(
        [*history, msg("system", "Env: linux."), msg("user", "Two?")],
        inline_system="fold",
        requires_alternation=probe_template(render).requires_alternation,
    )
    assert all(m["content"] != "Env: linux." for m in folded)
    text = render(folded, True)
    # Everything up to the end of the last user turn's own text is unchanged.
    kept = before[: before.index("Question one?") + len("Question one?")]
    assert text.startswith(kept)
    encode = embedded_model.tokenizer.encode
    assert encode(text)[: len(encode(kept))] == encode(kept)


def test_chatml_template_of_the_embedded_model_preserves(embedded_model: LoadedModel) -> None:
    assert embedded_model.chat_template is not None
    traits = probe_template(renderer(embedded_model.chat_template))
    assert traits.inline_system == "preserve"
    assert not traits.requires_alternation


def test_fold_appends_to_the_previous_user_turn() -> None:
    out = fold_inline_system([msg("system", "S"), msg("user", "U"), msg("system", "X")])
    assert out == [msg("system", "S"), msg("user", "U\n\nX")]


def test_fold_goes_after_tool_results() -> None:
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}
    result = {"role": "tool", "tool_call_id": "c", "content": "out"}
    out = fold_inline_system([msg("user", "U"), call, msg("system", "X"), result, msg("user", "V")])
    assert out == [msg("user", "U"), call, result, msg("user", "X\n\nV")]
    trailing = fold_inline_system([msg("user", "U"), call, result, msg("system", "X")])
    assert trailing == [msg("user", "U"), call, result, msg("user", "X")]


def test_fold_never_hoists_and_drops_empty() -> None:
    out = fold_inline_system(
        [msg("user", "U"), msg("assistant", "A"), msg("system", ""), msg("system", "X")]
    )
    assert out == [msg("user", "U"), msg("assistant", "A"), msg("user", "X")]
    assert out[0] == msg("user", "U")


def test_merge_same_roles_only_when_asked() -> None:
    convo = [msg("user", "a"), msg("user", "b"), msg("assistant", "c")]
    assert merge_same_roles(convo) == [msg("user", "a\n\nb"), msg("assistant", "c")]
    assert normalize_messages(convo, inline_system="preserve", requires_alternation=False) == convo


def test_alternation_is_detected() -> None:
    strict = next(r for r in ROWS if r["file"] == "google-gemma-2-2b-it.jinja")
    source = (templates_dir() / strict["file"]).read_text(encoding="utf-8")
    assert probe_template(renderer(source)).requires_alternation


def test_tool_rendering_is_detected(embedded_model: LoadedModel) -> None:
    from compat_serve.chat.prompt import PromptBuilder

    smol = PromptBuilder(embedded_model.chat_template, embedded_model.tokenizer)
    assert not smol.traits.renders_tools  # SmolLM2's ChatML template has no tools block
    qwen = (templates_dir() / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    assert PromptBuilder(qwen, embedded_model.tokenizer).traits.renders_tools


R1_END = "<\uff5cend\u2581of\u2581sentence\uff5c>"  # full-width bars, as DeepSeek writes it


@pytest.mark.parametrize(
    ("file", "turn_end"),
    [
        ("Qwen-Qwen3-0.6B.jinja", "<|im_end|>"),
        ("MiniMaxAI-MiniMax-M2.jinja", "[e~["),
        ("meta-llama-Llama-3.3-70B-Instruct.jinja", "<|eot_id|>"),
        ("ibm-granite-granite-3.0-8b-instruct.jinja", "<|end_of_text|>"),
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", R1_END),
        ("google-gemma-4-31B-it.jinja", "<turn|>"),
        ("ai-sage-GigaChat3-10B-A1.8B.jinja", "<|message_sep|>"),
    ],
)
def test_probe_finds_how_the_template_ends_an_assistant_turn(file: str, turn_end: str) -> None:
    traits = probe_template(renderer((templates_dir() / file).read_text(encoding="utf-8")))
    assert traits.assistant_turn_end == turn_end


def test_a_template_that_cannot_end_on_an_assistant_turn_tells_no_end() -> None:
    source = (
        "{% for m in messages %}{% if m.role == 'assistant' and loop.last %}"
        "{{ raise_exception('no') }}{% endif %}{{ m.content }}{% endfor %}"
    )
    assert probe_template(renderer(source)).assistant_turn_end == ""
