"""`reasoning.encrypted_content`: the reasoning text in an opaque, integrity-protected
blob that a client (Codex, with `store: false`) sends back to restore it in the prompt.

The blob is `cs1.<base64url(text)>.<base64url(HMAC-SHA256(key, text))>`: authenticated,
not secret (the client saw the reasoning anyway). The key is random per process unless
`COMPAT_SERVE_REASONING_KEY` sets one (replicas, restarts). A blob this server cannot
verify (another key, another server) restores nothing: the reasoning is dropped from
the prompt, as a template that hides past reasoning would do, instead of failing a
conversation that outlived a restart.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os

PREFIX = "cs1"
KEY_ENV = "COMPAT_SERVE_REASONING_KEY"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class ReasoningSeal:
    def __init__(self, key: bytes | None = None) -> None:
        configured = os.environ.get(KEY_ENV)
        self._key = key or (configured.encode() if configured else os.urandom(32))

    def _tag(self, data: bytes) -> bytes:
        return hmac.new(self._key, data, hashlib.sha256).digest()

    def seal(self, reasoning: str) -> str:
        data = reasoning.encode()
        return f"{PREFIX}.{_b64(data)}.{_b64(self._tag(data))}"

    def open(self, blob: str) -> str | None:
        """The reasoning in `blob`, None when it is not one of this server's blobs."""
        parts = blob.split(".")
        if len(parts) != 3 or parts[0] != PREFIX:
            return None
        try:
            data, tag = _unb64(parts[1]), _unb64(parts[2])
        except (binascii.Error, ValueError):
            return None
        if not hmac.compare_digest(tag, self._tag(data)):
            return None
        try:
            return data.decode()
        except UnicodeDecodeError:
            return None
