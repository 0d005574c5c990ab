"""The tokenizer of an embedding or reranker directory (`tokenizer.json`, read by the
`tokenizers` library): single texts and pairs with the model's own special tokens (its
post-processor: BERT's `[CLS] a [SEP] b [SEP]`, XLM-R's `<s> a </s></s> b </s>`,
Qwen3-Embedding's trailing `<|endoftext|>`), never truncated here: the caller decides
whether a long input is an error or is cut (`max_tokens`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from compat_serve.models.errors import ModelLoadError

if TYPE_CHECKING:
    from tokenizers import Tokenizer


class TextTokens:
    def __init__(self, tokenizer: Tokenizer) -> None:
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tokenizer = tokenizer

    @classmethod
    def from_dir(cls, model_dir: Path) -> TextTokens:
        from tokenizers import Tokenizer

        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(
                f"{model_dir}: no tokenizer.json (embedding models need the fast tokenizer file)"
            )
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as exc:  # the tokenizers library raises plain Exception
            raise ModelLoadError(f"{path}: cannot read the tokenizer: {exc}") from exc

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=special).ids)

    def encode_pair(self, first: str, second: str) -> list[int]:
        return list(self._tokenizer.encode(first, second, add_special_tokens=True).ids)

    def token_id(self, token: str) -> int | None:
        found = self._tokenizer.token_to_id(token)
        return int(found) if found is not None else None

    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))
