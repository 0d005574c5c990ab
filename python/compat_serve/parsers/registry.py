"""The tool-call formats by name, and which one a chat template speaks."""

from __future__ import annotations

from dataclasses import replace

from compat_serve.parsers.formats import (
    command_r,
    functionary,
    gemma4,
    glm,
    granite,
    harmony,
    llama3,
    minimax,
    mistral,
    nemotron,
    pythonic,
    sections,
    xml_function,
)
from compat_serve.parsers.reasoning import GEMMA4, REASONING_TAGS, THINK, ReasoningTags
from compat_serve.parsers.tool_calls import ToolFormat

_TAG = {"<tool_call>": xml_function.ToolCallTagRegion}
_TAG_MARKUP = ("<tool_call>", "</tool_call>")
_XML_MARKUP = (*_TAG_MARKUP, "<function=", "</function>", "<parameter=", "</parameter>")

TOOL_FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (
        ToolFormat("hermes", _TAG, _TAG_MARKUP, xml_function.hermes_grammar),
        ToolFormat(
            "qwen3_coder",
            {**_TAG, "<function=": xml_function.FunctionRegion},
            _XML_MARKUP,
            xml_function.qwen3_coder_grammar,
        ),
        ToolFormat(
            "seed_oss",
            {"<seed:tool_call>": xml_function.SeedToolCallRegion},
            ("<seed:tool_call>", "</seed:tool_call>", *_XML_MARKUP[2:]),
            xml_function.seed_oss_grammar,
        ),
        ToolFormat(
            "llama3",
            {llama3.PYTHON_TAG: llama3.PythonTagRegion, llama3.BARE_JSON: llama3.JsonCallRegion},
            (llama3.PYTHON_TAG,),
            llama3.llama3_grammar,
        ),
        ToolFormat(
            "mistral",
            {mistral.TOOL_CALLS: mistral.MistralRegion},
            (mistral.TOOL_CALLS, mistral.ARGS, mistral.CALL_ID),
            mistral.mistral_grammar,
        ),
        ToolFormat(
            "mistral_call_id",
            {mistral.TOOL_CALLS: mistral.MistralRegion},
            (mistral.TOOL_CALLS, mistral.ARGS, mistral.CALL_ID),
            mistral.mistral_call_id_grammar,
        ),
        ToolFormat(
            "mistral_args",
            {mistral.TOOL_CALLS: mistral.MistralRegion},
            (mistral.TOOL_CALLS, mistral.ARGS, mistral.CALL_ID),
            mistral.mistral_args_grammar,
        ),
        ToolFormat(
            "glm45",
            {"<tool_call>": glm.GlmToolCallRegion},
            (*_TAG_MARKUP, glm.KEY_OPEN, glm.KEY_CLOSE, glm.VALUE_OPEN, glm.VALUE_CLOSE),
            glm.glm45_grammar,
        ),
        ToolFormat(
            "deepseek_v3",
            {sections.DS_CALLS_BEGIN: sections.DeepSeekRegion},
            (
                sections.DS_CALLS_BEGIN,
                sections.DS_CALLS_END,
                sections.DS_CALL_BEGIN,
                sections.DS_CALL_END,
                sections.DS_SEP,
            ),
            sections.deepseek_v3_grammar,
        ),
        ToolFormat(
            "kimi_k2",
            {sections.KIMI_SECTION_BEGIN: sections.KimiRegion},
            (
                sections.KIMI_SECTION_BEGIN,
                sections.KIMI_SECTION_END,
                sections.KIMI_CALL_BEGIN,
                sections.KIMI_ARGS_BEGIN,
                sections.KIMI_CALL_END,
            ),
            sections.kimi_k2_grammar,
        ),
        ToolFormat(
            "nemotron",
            {nemotron.TOOLCALL_OPEN: nemotron.NemotronRegion},
            (nemotron.TOOLCALL_OPEN, nemotron.TOOLCALL_CLOSE),
            nemotron.nemotron_grammar,
        ),
        ToolFormat(
            "granite",
            {granite.TOOL_CALL: granite.GraniteRegion},
            (granite.TOOL_CALL, granite.TOOL_CALL_CLOSE),
            granite.granite_grammar,
        ),
        ToolFormat(
            "phi4_mini",
            {granite.TOOL_CALL: granite.GraniteRegion},
            (granite.TOOL_CALL, granite.TOOL_CALL_CLOSE),
            granite.phi4_mini_grammar,
        ),
        ToolFormat(
            "command_r7b",
            {
                command_r.START_ACTION: command_r.ActionRegion,
                command_r.START_RESPONSE: command_r.ResponseMarkup,
                command_r.END_RESPONSE: command_r.ResponseMarkup,
            },
            command_r.MARKUP,
            command_r.command_r7b_grammar,
        ),
        ToolFormat(
            "command_r_plus",
            {command_r.ACTION_JSON: command_r.FencedActionRegion},
            (command_r.ACTION_JSON,),  # not the fence: DeepSeek writes '```json' as text
            command_r.command_r_plus_grammar,
        ),
        ToolFormat(
            "functionary_v3_1",
            {xml_function.FUNCTION_OPEN: xml_function.FunctionRegion},
            (xml_function.FUNCTION_OPEN, xml_function.FUNCTION_CLOSE),
            functionary.functionary_v3_1_grammar,
        ),
        ToolFormat(
            "functionary_v3_2",
            {functionary.RECIPIENT: functionary.RecipientRegion},
            (functionary.RECIPIENT,),
            functionary.functionary_v3_2_grammar,
        ),
        ToolFormat(
            "harmony",
            {},
            harmony.MARKUP,
            harmony.harmony_grammar,
            free_text_grammar=False,
            turn_grammar=harmony.harmony_turn_grammar,
            whole_output=harmony.harmony_parser,
            reasoning_markup=harmony.BUDGET_MARKUP,
        ),
        ToolFormat(
            "minimax_m2",
            {minimax.BLOCK_OPEN: minimax.MiniMaxRegion},
            minimax.MARKUP,
            minimax.minimax_m2_grammar,
        ),
        ToolFormat(
            "gemma4",
            {gemma4.CALL_OPEN: gemma4.Gemma4Region},
            gemma4.MARKUP,
            gemma4.gemma4_grammar,
        ),
        ToolFormat(
            "lfm2",
            {pythonic.CALL_START: pythonic.PythonicRegion},
            (pythonic.CALL_START, pythonic.CALL_END),
            pythonic.lfm2_grammar,
        ),
        # Unknown templates: the common JSON and XML styles are parsed; constrained calls
        # are written Hermes-style, the most widely trained of them.
        ToolFormat(
            "generic",
            {
                **_TAG,
                "<function=": xml_function.FunctionRegion,
                llama3.BARE_JSON: llama3.JsonCallRegion,
            },
            _XML_MARKUP,
            xml_function.hermes_grammar,
        ),
    )
}

# (substring of the chat template, format), most specific first: GLM and Qwen3-Coder
# templates also mention <tool_call>.
_DETECTION: tuple[tuple[str, str], ...] = (
    (harmony.CHANNEL, "harmony"),
    (minimax.BLOCK_OPEN, "minimax_m2"),
    (gemma4.CALL_OPEN, "gemma4"),
    (pythonic.CALL_START, "lfm2"),
    ("List of tools: [", "lfm2"),  # LFM2.5's template names no call markup
    (nemotron.TOOLCALL_OPEN, "nemotron"),
    (command_r.START_ACTION, "command_r7b"),
    ('"tool_name"', "command_r_plus"),  # the R+ tool_use template's action list
    (granite.TOOL_CALL_CLOSE, "phi4_mini"),
    ("<|/tool|>", "phi4_mini"),  # Phi-4-mini's template: tools between <|tool|> and <|/tool|>
    (granite.TOOL_CALL, "granite"),
    (functionary.FUNCTION_JSON_EXAMPLE, "functionary_v3_1"),  # before qwen3_coder's <function=
    (functionary.RECIPIENT + functionary.TEXT_RECIPIENT, "functionary_v3_2"),
    (sections.DS_CALLS_BEGIN, "deepseek_v3"),
    (sections.KIMI_SECTION_BEGIN, "kimi_k2"),
    (mistral.CALL_ID, "mistral_call_id"),  # Small 3.2: NAME[CALL_ID]id[ARGS]
    (mistral.ARGS, "mistral_args"),  # Devstral: NAME[ARGS], no ids
    (mistral.TOOL_CALLS, "mistral"),
    ("<arg_key>", "glm45"),
    ("<seed:tool_call>", "seed_oss"),
    ("<function=", "qwen3_coder"),
    ("<tool_call>", "hermes"),
    (llama3.PYTHON_TAG, "llama3"),
    ('"parameters": ', "llama3"),
)

REASONING_CHOICES = ("auto", *REASONING_TAGS, "none")


def tool_format_names() -> list[str]:
    return ["auto", *TOOL_FORMATS, "none"]


def detect_tool_format(template: str | None) -> ToolFormat:
    """The format a chat template teaches its model (generic when it names none)."""
    for needle, name in _DETECTION:
        if template and needle in template:
            return TOOL_FORMATS[name]
    return TOOL_FORMATS["generic"]


def template_uses_think_tags(template: str | None) -> bool:
    return bool(template) and "</think>" in (template or "")


def check_parser_choices(tool_parser: str, reasoning_parser: str) -> None:
    """Raise ValueError for an unknown --tool-parser / --reasoning-parser name."""
    if tool_parser not in tool_format_names():
        raise ValueError(
            f"--tool-parser must be one of {', '.join(tool_format_names())}, not {tool_parser!r}"
        )
    if reasoning_parser not in REASONING_CHOICES:
        raise ValueError(
            f"--reasoning-parser must be one of {', '.join(REASONING_CHOICES)}, "
            f"not {reasoning_parser!r}"
        )


def resolve_tool_format(choice: str, template: str | None) -> ToolFormat | None:
    """`--tool-parser`: auto (detect), a format name, or none (calls stay text)."""
    if choice == "auto":
        return detect_tool_format(template)
    check_parser_choices(choice, "auto")
    return None if choice == "none" else TOOL_FORMATS[choice]


def resolve_reasoning(choice: str, template: str | None) -> ReasoningTags | None:
    """`--reasoning-parser`: auto (the tags the template knows), a tag style (think,
    gemma4), or none. Harmony's analysis channel is read by its own parser."""
    check_parser_choices("auto", choice)
    if choice != "auto":
        return REASONING_TAGS.get(choice)
    if template and GEMMA4.open in template:
        return GEMMA4
    if not template_uses_think_tags(template):
        return None
    if _STEP_EMPTY_THINKING in (template or ""):  # its history: `<think>\n` + `\n</think>\n`
        return replace(THINK, closed_layout=("\n", "\n"))
    return THINK


# How Step-3.5's template renders the end of a (possibly empty) reasoning block.
_STEP_EMPTY_THINKING = "reasoning_content + '\\n</think>\\n' + content"
