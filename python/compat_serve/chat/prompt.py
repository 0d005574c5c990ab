"""Chat messages → prompt text (Rust template) → token ids. No HTTP, no MLX."""

from __future__ import annotations

import dataclasses
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from compat_serve.chat.breakpoints import breakpoint_offsets
from compat_serve.chat.call_shapes import RESHAPES
from compat_serve.chat.images import replace_markers
from compat_serve.chat.normalize import normalize_messages
from compat_serve.chat.probe import TemplateTraits, probe_template
from compat_serve.chat.reply_history import (
    REPLY_HISTORY_MODES,
    GeneratedReply,
    ReplyHistory,
    reply_key,
    text_digest,
)
from compat_serve.chat.reply_splice import splice_echoed_reply
from compat_serve.chat.tool_injection import envelope_text, inject_tools
from compat_serve.chat.types import ChatRequest, Message
from compat_serve.templating import ChatTemplate, TemplateError

if TYPE_CHECKING:
    from compat_serve.models.vision_input import VisionInput


class Encoder(Protocol):
    bos_token: str | None
    eos_token: str | None

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...

    def with_special_tokens(self, ids: Sequence[int]) -> list[int]: ...


class PromptError(ValueError):
    """The conversation cannot be turned into a prompt (the client's mistake)."""


@dataclass(frozen=True)
class Prompt:
    text: str
    token_ids: tuple[int, ...]
    # A vision-language model's images in the prompt (server/images.py builds it).
    vision: VisionInput | None = None
    # The digest of the template's own rendering (before an echoed reply is spliced in):
    # a reply generated from this prompt is recognised by it next turn.
    rendered: bytes = b""
    # The tools were told in the system prompt and past turns rendered as JSON envelopes
    # (chat/tool_injection.py): a reply to it is echoed back as its envelope text.
    envelope: bool = False
    # Prompt-cache pins: `(end_token, ttl_seconds)` per `cache_control` breakpoint.
    pins: tuple[tuple[int, int], ...] = ()


class NoChatTemplateError(PromptError):
    """The model ships no chat template (a base model) and none was given."""


# No fallback template: any guess writes role markers the model never saw, and often tokens
# its vocabulary lacks (a ChatML guess on Gemma answered "<|im_assistant>assistant").
NO_CHAT_TEMPLATE = (
    "this model has no chat template, so a conversation cannot be turned into its prompt: "
    "start the server with --chat-template FILE (a Jinja chat template for this model), or "
    "send the text as the model should read it to the completions APIs "
    "(/v1/completions, or Ollama's /api/generate with raw: true)"
)

# What the probe would conclude for a template that renders nothing.
_NO_TEMPLATE_TRAITS = TemplateTraits(
    inline_system="fold",
    inline_system_reason="no chat template",
    requires_alternation=False,
)


class PromptBuilder:
    """Renders conversations with the model's template, normalized the way it needs.

    `inline_system`: "auto" probes the template (chat/probe.py); "preserve"/"fold" force
    that policy. Same-role merging follows the probe's alternation answer.
    `reply_history`: which echoed replies are spliced in as generated
    (chat/reply_history.py): "loop", "all" or "template" (none).
    """

    def __init__(
        self,
        template_source: str | None,
        tokenizer: Encoder,
        *,
        inline_system: str = "auto",
        reply_history: str = "loop",
    ) -> None:
        if inline_system not in ("auto", "preserve", "fold"):
            raise ValueError(f"inline_system must be auto, preserve or fold, not {inline_system!r}")
        if reply_history not in REPLY_HISTORY_MODES:
            raise ValueError(
                f"reply_history must be one of {', '.join(REPLY_HISTORY_MODES)}, "
                f"not {reply_history!r}"
            )
        self.reply_history_mode = reply_history
        self.template_source = template_source
        # None: every chat request is refused with NO_CHAT_TEMPLATE (completions still work).
        self._template = ChatTemplate(template_source) if template_source else None
        self._tokenizer = tokenizer
        probed = (
            probe_template(
                lambda messages, gen: self.render(messages, add_generation_prompt=gen),
                lambda messages, tools: self.render(messages, tools=tools),
            )
            if self._template is not None
            else _NO_TEMPLATE_TRAITS
        )
        if inline_system != "auto":
            probed = dataclasses.replace(
                probed, inline_system=inline_system, inline_system_reason="set by --inline-system"
            )
        self.traits = probed
        # Set when the template ignores `tools` and the model answers in the JSON envelope
        # (parsers/formats/envelope.py): tools are told in the system prompt instead.
        self.injects_tools = False
        # Recent replies with the prompts they answered: spliced in when echoed (the only
        # place where generated ids stand in for the tokenizer's; see `build`).
        self.generated = ReplyHistory()

    @property
    def has_template(self) -> bool:
        return self._template is not None

    def normalize(self, messages: Sequence[Message]) -> list[Message]:
        return normalize_messages(
            list(messages),
            inline_system=self.traits.inline_system,
            requires_alternation=self.traits.requires_alternation,
        )

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        if self._template is None:
            raise NoChatTemplateError(NO_CHAT_TEMPLATE)
        try:
            text: str = self._template.render(
                list(messages),
                tools=tools or None,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                bos_token=self._tokenizer.bos_token,
                eos_token=self._tokenizer.eos_token,
                **kwargs,
            )
        except TemplateError as exc:
            raise PromptError(f"chat template error: {exc}") from exc
        if continue_final_message:
            text = _cut_after_final_content(text, messages)
        return text

    def encode(self, text: str) -> list[int]:
        # The template already writes BOS where the model wants it. Text is always
        # tokenized as a whole: the same text gives the same ids whatever was generated
        # before (generated ids come in only through an echoed reply's splice).
        return self._tokenizer.encode(text, add_special_tokens=False)

    def encode_text(self, text: str) -> list[int]:
        """Text no template wraps (completions, Ollama's raw generate): the ids of `text`
        with BOS/EOS as the model's metadata asks; [] when the text itself gives no token
        (a vocabulary without its characters), so callers can refuse it."""
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        return self._tokenizer.with_special_tokens(ids) if ids else []

    def remember_generated(
        self,
        prompt: Prompt,
        text: str,
        calls: Sequence[tuple[str, str, Any]],
        token_ids: Sequence[int],
        stop_token_id: int | None,
        reasoning: str = "",
    ) -> None:
        """A reply the model generated for `prompt`: its visible `text` and `calls`
        ((id, name, arguments) as the client gets them), its ids without the stop token.
        Unless `--reply-history template`, it and the prompt it answered are kept, so a
        next turn that echoes exactly this reply continues from both."""
        if prompt.vision is not None or self.reply_history_mode == "template":
            return
        pieces = self._pieces(token_ids)
        if pieces is None:
            return
        if prompt.envelope:
            # The next turn renders the echo as the envelope (tool_injection.py), with
            # no call ids: it is recognised by its whole content.
            shaped = [{"function": {"name": name, "arguments": args}} for _, name, args in calls]
            key = reply_key(envelope_text(text, shaped), [])
        else:
            key = reply_key(text, calls)
        # Where the reply ends in the template's rendering: the stop token the model
        # wrote (or, cut short, the model's end-of-turn tokens) and the template's own
        # assistant-turn end (the same text unless the template is not the model's own).
        stops = [stop_token_id] if stop_token_id is not None else self._end_of_turn_ids()
        texts = ["".join(self._pieces([t]) or ()) for t in stops]
        markers = tuple(dict.fromkeys(m for m in [*texts, self.traits.assistant_turn_end] if m))
        if not markers:
            return
        reply = GeneratedReply(
            prompt_text=prompt.text,
            prompt_ids=array("I", prompt.token_ids),
            rendered_digest=prompt.rendered,
            reply_text="".join(pieces),
            reply_ids=tuple(token_ids),
            end_markers=markers,
            reasoning="".join(reasoning.split()),
        )
        self.generated.remember(key, reply)

    def _end_of_turn_ids(self) -> list[int]:
        ids = getattr(self._tokenizer, "eos_token_ids", None) or ()
        return sorted(int(i) for i in ids)

    def _pieces(self, token_ids: Sequence[int]) -> list[str] | None:
        """The text each id adds (special tokens as text), None without a decoder."""
        decode_stream = getattr(self._tokenizer, "decode_stream", None)
        if decode_stream is None or not token_ids:
            return None
        decoder = decode_stream(skip_special_tokens=False)
        return [decoder.step(t) for t in token_ids]

    def _render_calls(self, messages: list[Message], **kwargs: Any) -> str:
        """`render`, retried with past tool calls in the shapes some templates need
        (chat/call_shapes.py), in their fixed order, when the usual shape fails: the
        first shape that renders wins, so a request renders the same whatever came
        before it. The first error stands when none works."""
        try:
            return self.render(messages, **kwargs)
        except PromptError:
            if not any(m.get("tool_calls") for m in messages):
                raise
            first_error = sys.exc_info()[1]
        for reshape in RESHAPES:
            try:
                return self.render(reshape(messages), **kwargs)
            except PromptError:
                continue
        assert first_error is not None
        raise first_error

    def build(self, request: ChatRequest, image_markup: str | None = None) -> Prompt:
        """`image_markup`: what the model's template writes for one image (vision models);
        each image marker of the rendered text becomes it before tokenization."""
        messages, tools = request.messages, request.tools
        envelope = bool(self.injects_tools and tools)
        if envelope and tools:
            messages = inject_tools(
                messages, tools, continue_final_message=request.continue_final_message
            )
            tools = None
        normalized = self.normalize(messages)
        text = self._render_calls(
            normalized,
            tools=tools,
            continue_final_message=request.continue_final_message,
            **request.template_kwargs,
        )
        rendered = text_digest(text)
        if request.images:
            if image_markup is None:
                raise PromptError("this model is text-only and cannot read images")
            text = replace_markers(text, image_markup, len(request.images))
        elif self.reply_history_mode != "template" and not request.continue_final_message:
            splice = splice_echoed_reply(
                normalized,
                text,
                lambda msgs, gen: self._render_calls(
                    msgs, tools=tools, add_generation_prompt=gen, **request.template_kwargs
                ),
                self.generated,
                self.reply_history_mode,
                PromptError,
            )
            if splice is not None:
                ids = splice.head_ids + tuple(self.encode(splice.tail))
                pins = self._pins(request, messages, tools, text, ids)
                return Prompt(splice.text, ids, rendered=rendered, envelope=envelope, pins=pins)
        ids = tuple(self.encode(text))
        pins = () if request.images else self._pins(request, messages, tools, text, ids)
        return Prompt(text, ids, rendered=rendered, envelope=envelope, pins=pins)

    def _pins(
        self,
        request: ChatRequest,
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
        text: str,
        ids: tuple[int, ...],
    ) -> tuple[tuple[int, int], ...]:
        """Token offsets of the request's cache breakpoints in the served prompt."""
        if not request.cache_breakpoints:
            return ()
        return breakpoint_offsets(
            request.cache_breakpoints,
            lambda count: self._render_calls(
                self.normalize(messages[:count]),
                tools=tools,
                add_generation_prompt=False,
                **request.template_kwargs,
            ),
            text,
            ids,
            self.encode,
        )


def _cut_after_final_content(text: str, messages: Sequence[Message]) -> str:
    """Drop the end-of-turn markup after a final assistant message so output continues it."""
    if not messages or messages[-1].get("role") != "assistant":
        raise PromptError("continuing a message needs a final assistant message")
    content = messages[-1].get("content") or ""
    if not isinstance(content, str) or not content:
        return text
    at = text.rfind(content)
    if at == -1:
        raise PromptError("the chat template does not render the final assistant message")
    return text[: at + len(content)]
