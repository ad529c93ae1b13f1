"""Which revision serves a request while a change is on trial (`splits.Split`): the share, and
the bucket that keeps a conversation on its side."""

from __future__ import annotations

from typing import Any

import orjson

from iop.edge.bodies import ParsedRequest, parse_request
from iop.edge.pool import CANDIDATE, STABLE, PoolSnapshot, Split
from iop.edge.pool.splits import BUCKETS, sticky_bucket


def chat(*contents: str, user: str | None = None) -> ParsedRequest:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            *({"role": "user", "content": c} for c in contents),
        ],
    }
    if user is not None:
        body["user"] = user
    return parse_request("chat", orjson.dumps(body))


def test_a_conversation_keeps_its_bucket_as_it_grows_and_a_user_keeps_theirs() -> None:
    first = sticky_bucket(chat("hello"), "team-a")
    assert sticky_bucket(chat("hello", "and then?", "more"), "team-a") == first
    assert sticky_bucket(chat("x", user="u-1"), "team-a") == sticky_bucket(
        chat("y", user="u-1"), "team-a"
    )
    # The principal is part of it: two teams with the same opening are two conversations.
    buckets = {sticky_bucket(chat("hello"), f"team-{n}") for n in range(50)}
    assert len(buckets) > 45


def test_a_share_takes_about_its_share_of_conversations_and_only_of_shared_models(
    config_of, provider
) -> None:
    snapshot = PoolSnapshot.build(config_of([provider("pa")], {"m": ["pa"], "n": ["pa"]}))
    split = Split(snapshot, frozenset({"m", "n"}), frozenset({"m"}), 5)
    sides = [split.side_of("m", chat(f"conversation {i}"), "p") for i in range(4000)]
    assert 0.04 < sides.count(CANDIDATE) / len(sides) < 0.06
    assert split.side_of("n", chat("any"), "p") == CANDIDATE  # touched, not shared: all of it
    assert split.side_of("other", chat("any"), "p") == STABLE  # untouched
    # Shares only grow, so a conversation on the candidate stays there at the next step.
    wider = split.with_share(25)
    for i in range(400):
        request = chat(f"conversation {i}")
        if split.side_of("m", request, "p") == CANDIDATE:
            assert wider.side_of("m", request, "p") == CANDIDATE
    assert split.with_share(100).side_of("m", chat("z"), "p") == CANDIDATE
    assert 0 <= sticky_bucket(chat("q"), "p") < BUCKETS
