"""A request's prompt as prefix points: what `prefix_affinity` remembers and hashes.

A model server keeps the KV cache of the prompts it served, by prefix: a request whose prompt
begins like an earlier one (the same system prompt, the earlier turns of its conversation) skips
the prefill of that part if it goes to the same server. So the Edge hashes the prompt's leading
parts into a chain, each hash covering the one before it and one more part:

- a chat prompt: one part per message (its role and content; a content of parts as its JSON),
  and one point per message from the first `user` message on. A conversation's later turns
  repeat its earlier messages unchanged, so they carry every point of the turns before them,
  and the first point (the anchor: system prompt and first user message) is the same in every
  turn: it names the conversation. Points before it (a system prompt many conversations share)
  are not points: they would send every conversation with that system prompt to one server.
- a text prompt (`/v1/completions`): parts of `BLOCK_BYTES` bytes, a point per full part (the
  whole prompt when it is shorter); its first part is its anchor. A list of prompts counts by
  its first; token ids as their decimal text.

At most `MAX_POINTS` points are kept: the anchor and the deepest others. BLAKE2b, keyed by
nothing: every Edge replica computes the same points for the same prompt. Embeddings have no KV
cache to go back to: they get no key (the policy picks the least loaded).
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
