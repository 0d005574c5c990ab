"""The API key a request presents, and the prefix-cache salt derived from it."""

from __future__ import annotations

import hashlib

from fastapi import Request


def presented_key(request: Request) -> str | None:
    """`x-api-key`, else an `Authorization: Bearer` token, else None."""
    key = request.headers.get("x-api-key")
    if key:
        return key
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def cache_salt(request: Request, *, per_key: bool) -> bytes | None:
    """With --cache-salt-per-key, requests under different keys never share cached
    blocks: the key's digest is mixed into the block hashes (requests without a key
    share the unsalted cache)."""
    if not per_key:
        return None
    key = presented_key(request)
    return hashlib.sha256(key.encode()).digest() if key else None
