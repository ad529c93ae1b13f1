"""A request's prompt as prefix points: what `prefix_affinity` remembers and hashes.

The Edge hashes the prompt's leading parts into a chain, each hash covering the one before it
and one more part: a chat prompt one point per message from the first `user` message on (the
first point, the anchor, names the conversation: its system prompt and first user message); a
text prompt a point per full `BLOCK_BYTES` part; a Responses prompt as a chat, its
instructions the system message. At most `MAX_POINTS` points are kept: the anchor
and the deepest others. Each point carries the prompt bytes it covers (a message's role and
content, as the Edge reads them), for the prefill a server that holds it is spared. BLAKE2b,
keyed by nothing, so every Edge replica computes the same points for the same prompt. Embeddings
get no key (the policy picks the least loaded). docs/edge.md, "Choosing among equals", says why a
conversation's points are so.
"""

from __future__ import annotations

import hashlib
from typing import Any, Final

import orjson

from ..bodies import ParsedRequest
from .choosing import PrefixKey

#: Bytes of a text prompt per part (about 64 tokens at the Edge's 4 bytes a token).
BLOCK_BYTES: Final = 256
#: Most points a key keeps: its anchor and the deepest others.
MAX_POINTS: Final = 32
_DIGEST: Final = 16


def prefix_key(request: ParsedRequest) -> PrefixKey | None:
    """The prefix points of a request's prompt; None for a request without one (embeddings)."""
    if request.kind == "chat":
        return _chat(request.document["messages"])
    if request.kind == "completion":
        return _text(request.document["prompt"])
    if request.kind == "response":
        return _chat(_as_messages(request.document))
    return None


def _as_messages(document: dict[str, Any]) -> list[dict[str, Any]]:
    """A Responses request's prompt as chat messages, as a server renders it: its
    `instructions` as the system message, then its input (text: one user message; items:
    each by its role, or its type for what is not a message, such as a function call)."""
    messages: list[dict[str, Any]] = []
    instructions = document.get("instructions")
    if isinstance(instructions, str):
        messages.append({"role": "system", "content": instructions})
    value = document["input"]  # validated: text or items
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
        return messages
    for item in value:
        role = item.get("role") or item["type"]
        messages.append({"role": role, "content": item.get("content", item)})
    return messages


def _chat(messages: list[dict[str, Any]]) -> PrefixKey:
    """A chat's points (its messages validated: objects with a string `role`)."""
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), 0)
    chain = b""
    points: list[bytes] = []
    sizes: list[int] = []
    size = 0
    for index, message in enumerate(messages):
        role = message["role"].encode()
        content = _content_bytes(message.get("content"))
        chain = hashlib.blake2b(chain + role + b"\0" + content, digest_size=_DIGEST).digest()
        size += len(role) + len(content)
        if index >= first_user:
            points.append(chain)
            sizes.append(size)
    return _key(points, sizes, size)


def _text(prompt: Any) -> PrefixKey:
    if isinstance(prompt, list) and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of prompts: by its first
    if isinstance(prompt, str):
        data = prompt.encode()
    else:  # token ids
        data = ",".join(map(str, prompt)).encode()
    chain = b""
    points: list[bytes] = []
    sizes: list[int] = []
    full = len(data) - len(data) % BLOCK_BYTES
    for start in range(0, max(full, BLOCK_BYTES), BLOCK_BYTES):
        part = data[start : start + BLOCK_BYTES]
        chain = hashlib.blake2b(chain + part, digest_size=_DIGEST).digest()
        points.append(chain)
        sizes.append(start + len(part))
    return _key(points, sizes, len(data))


def _key(points: list[bytes], sizes: list[int], size: int) -> PrefixKey:
    if len(points) > MAX_POINTS:
        points = [points[0], *points[-(MAX_POINTS - 1) :]]
        sizes = [sizes[0], *sizes[-(MAX_POINTS - 1) :]]
    return PrefixKey(tuple(points), tuple(sizes), size)


def _content_bytes(content: Any) -> bytes:
    if content is None:
        return b""
    if isinstance(content, str):
        return content.encode()
    return orjson.dumps(content)
