"""A request's prompt as prefix points: what `prefix_affinity` remembers and hashes.

The Edge hashes the prompt's leading parts into a chain, each hash covering the one before it
and one more part: a chat prompt one point per message from the first `user` message on (the
first point, the anchor, names the conversation: its system prompt and first user message); a
text prompt a point per full `BLOCK_BYTES` part. At most `MAX_POINTS` points are kept: the anchor
and the deepest others. BLAKE2b, keyed by nothing, so every Edge replica computes the same points
for the same prompt. Embeddings get no key (the policy picks the least loaded). docs/edge.md,
"Choosing among equals", says why a conversation's points are so.
"""

from __future__ import annotations

import hashlib
from typing import Any, Final

import orjson

from ..bodies import ChatCompletionBody, CompletionBody, ParsedRequest
from .choosing import PrefixKey

#: Bytes of a text prompt per part (about 64 tokens at the Edge's 4 bytes a token).
BLOCK_BYTES: Final = 256
#: Most points a key keeps: its anchor and the deepest others.
MAX_POINTS: Final = 32
_DIGEST: Final = 16


def prefix_key(request: ParsedRequest) -> PrefixKey | None:
    """The prefix points of a request's prompt; None for a request without one (embeddings)."""
    body = request.body
    if isinstance(body, ChatCompletionBody):
        return _chat(body)
    if isinstance(body, CompletionBody):
        return _text(body.prompt)
    return None


def _chat(body: ChatCompletionBody) -> PrefixKey:
    messages = body.messages
    first_user = next((i for i, m in enumerate(messages) if m.role == "user"), 0)
    chain = b""
    points: list[bytes] = []
    for index, message in enumerate(messages):
        chain = hashlib.blake2b(
            chain + message.role.encode() + b"\0" + _content_bytes(message.content),
            digest_size=_DIGEST,
        ).digest()
        if index >= first_user:
            points.append(chain)
    return _key(points)


def _text(prompt: Any) -> PrefixKey:
    if isinstance(prompt, list) and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of prompts: by its first
    if isinstance(prompt, str):
        data = prompt.encode()
    else:  # token ids
        data = ",".join(map(str, prompt)).encode()
    chain = b""
    points: list[bytes] = []
    full = len(data) - len(data) % BLOCK_BYTES
    for start in range(0, max(full, BLOCK_BYTES), BLOCK_BYTES):
        chain = hashlib.blake2b(
            chain + data[start : start + BLOCK_BYTES], digest_size=_DIGEST
        ).digest()
        points.append(chain)
    return _key(points)


def _key(points: list[bytes]) -> PrefixKey:
    if len(points) > MAX_POINTS:
        points = [points[0], *points[-(MAX_POINTS - 1) :]]
    return PrefixKey(tuple(points))


def _content_bytes(content: Any) -> bytes:
    if content is None:
        return b""
    if isinstance(content, str):
        return content.encode()
    return orjson.dumps(content)
