"""Tokenizer adapter over the `tokenizers` library, used by the engine for every model source.

Both GGUF files (tokenizer rebuilt from metadata, see `gguf_tokenizer.py`) and MLX/HF
directories (`tokenizer.json`) end up as one `tokenizers.Tokenizer` plus a little metadata:
which tokens are BOS/EOS, which ids end a turn, and which ids are special.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.decoders import DecodeStream

__all__ = ["END_OF_TURN_TOKENS", "IncrementalDecoder", "Tokenizer"]

# Tokens that end an assistant turn in common chat templates. One is added to the EOS set
# when the vocabulary has it and the chat template writes it.
END_OF_TURN_TOKENS: Final[tuple[str, ...]] = (
    "<|im_end|>",  # ChatML (SmolLM, Qwen, ...)
    "<|eot_id|>",  # Llama 3
    "<|eom_id|>",  # Llama 3 (tool call end of message)
    "<end_of_turn>",  # Gemma
    "<|end|>",  # Phi-3
    "<|return|>",  # gpt-oss
    "<|endofturn|>",
)


class Tokenizer:
    """Text <-> token ids, plus the special-token facts the engine needs.

    `encode` never adds special tokens unless asked: rendered chat prompts already carry
    them, and `<|im_start|>`-style control tokens in the text encode to their single ids.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self.bos_token: str | None = bos_token
        self.eos_token: str | None = eos_token
        self.pad_token: str | None = pad_token
        self.unk_token: str | None = unk_token
        # Whether text tokenized without a chat template (completions, raw generate) starts
        # with BOS / ends with EOS: the model's metadata says (GGUF `tokenizer.ggml.add_*`,
        # tokenizer_config.json `add_*_token`, else what tokenizer.json's post-processor adds).
        self.add_bos_token: bool = add_bos_token
        self.add_eos_token: bool = add_eos_token
        self._extra_eos = tuple(int(i) for i in extra_eos_token_ids)
        self._chat_template = chat_template

        self.bos_token_id: int | None = self.token_to_id(bos_token) if bos_token else None
        self.pad_token_id: int | None = self.token_to_id(pad_token) if pad_token else None
        eos_id = self.token_to_id(eos_token) if eos_token else None
        if eos_id is None and self._extra_eos:
            eos_id = self._extra_eos[0]
            self.eos_token = self.id_to_token(eos_id)
        self.eos_token_id: int | None = eos_id

        eos_ids: set[int] = set(self._extra_eos)
        if eos_id is not None:
            eos_ids.add(eos_id)
        if chat_template:
            for token in END_OF_TURN_TOKENS:
                tid = self.token_to_id(token)
                if tid is not None and token in chat_template:
                    eos_ids.add(tid)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)

        self.special_token_ids: frozenset[int] = frozenset(
            int(i) for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )

    # -- construction ---------------------------------------------------------------------

    def with_chat_template(self, chat_template: str | None) -> Tokenizer:
        """The same tokenizer, with end-of-turn ids recomputed for another chat template."""
        return Tokenizer(
            self._backend,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            pad_token=self.pad_token,
            unk_token=self.unk_token,
            extra_eos_token_ids=self._extra_eos,
            add_bos_token=self.add_bos_token,
            add_eos_token=self.add_eos_token,
            chat_template=chat_template,
        )

    @property
    def backend(self) -> BackendTokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._backend

    # -- encode / decode ------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text always map to their ids;
        `add_special_tokens` adds BOS and EOS where the model's metadata asks for them
        (`with_special_tokens`), for text that no chat template has wrapped.
        """
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        return self.with_special_tokens(ids) if add_special_tokens else ids

    def with_special_tokens(self, ids: Sequence[int]) -> list[int]:
        """`ids` with BOS in front and EOS behind as `add_bos_token` / `add_eos_token` say,
        never doubled: text that already starts with `<bos>` (or ends with EOS) keeps one."""
        out = list(ids)
        bos, eos = self.bos_token_id, self.eos_token_id
        if self.add_bos_token and bos is not None and (not out or out[0] != bos):
            out.insert(0, bos)
        if self.add_eos_token and eos is not None and (not out or out[-1] != eos):
            out.append(eos)
        return out

    def encode_batch(
        self, texts: Sequence[str], *, add_special_tokens: bool = False
    ) -> list[list[int]]:
        return [self.encode(t, add_special_tokens=add_special_tokens) for t in texts]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, *, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """A streaming detokenizer: feed ids one at a time, get text as soon as it is complete."""
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    # -- vocabulary -----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (may be smaller than the model's logit width)."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def __len__(self) -> int:
        return self.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return dict(self._backend.get_vocab(with_added_tokens=True))

    def id_to_token(self, token_id: int) -> str | None:
        token: str | None = self._backend.id_to_token(int(token_id))
        return token

    def token_to_id(self, token: str) -> int | None:
        tid: int | None = self._backend.token_to_id(token)
        return tid

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: Sequence[str]) -> list[int | None]:
        return [self.token_to_id(t) for t in tokens]

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_token_ids

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
            f"eos={self.eos_token!r}, eos_token_ids={sorted(self.eos_token_ids)})"
        )


class IncrementalDecoder:
    """Streaming detokenization that never splits a UTF-8 character or a BPE merge."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        """The new text this token completes ("" when it only starts a multi-byte character)."""
        chunk: str | None = self._stream.step(self._tokenizer.backend, int(token_id))
        return chunk or ""
