"""What a peer says in words is bounded before anyone logs, stores or shows it.

A Node with a valid token is still a peer whose words are not ours: a config refusal, an error
message, a provider's health detail may be any size (docs/reliability.md, "Hostile peers", has
what once reached an Edge's log). Every such text is cut once, where it comes off the wire
(`converting.py` and the Edge's session), to `MAX_TEXT_CHARS`, marked so a reader sees it was cut.
"""

from __future__ import annotations

from typing import Final

#: Most characters of a peer's sentence (an error message, a reason, a health detail) kept.
MAX_TEXT_CHARS: Final = 1024
#: Most characters of a peer's name for something (a node, provider or instance id) kept.
MAX_ID_CHARS: Final = 128


def bounded(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """`text`, cut to `limit` characters with a note of how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters cut)"
