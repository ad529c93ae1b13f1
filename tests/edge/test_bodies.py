"""The body's structure bounds and the input-token estimate, on parsed bodies (no server)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from iop.edge.bodies import (
    MEDIA_PART_TOKENS,
    BodyBounds,
    check_structure,
    estimate_tokens,
    is_long,
    parse_request,
)
from iop.edge.errors import BadRequest
from iop.wire import RunKind

HI = {"role": "user", "content": "hi"}
SMALL = BodyBounds(containers=1_000, items=10_000, depth=8, messages=50, content_parts=4, inputs=8)


def body(**fields: Any) -> bytes:
    return orjson.dumps({"model": "m", **fields})


def deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("kind", "raw", "param", "words"),
    [
        pytest.param(
            "chat", body(messages=[HI] * 51), "messages", "51 items, at most 50", id="messages"
        ),
        pytest.param(
            "chat",
            body(messages=[HI, {"role": "user", "content": [{"type": "text", "text": "a"}] * 5}]),
            "messages[1].content",
            "5 items, at most 4",
            id="content-parts",
        ),
        pytest.param(
            "embedding", body(input=["a"] * 9), "input", "9 items, at most 8", id="inputs"
        ),
        pytest.param("completion", body(prompt=[[1]] * 9), "prompt", "9 items", id="prompts"),
        pytest.param(
            "chat",
            body(messages=[HI], metadata={"a": deep(8)}),
            "metadata.a[0][0][0][0][0][0]",
            "nested deeper than 8 levels",
            id="depth",
        ),
        pytest.param(
            "chat",
            body(messages=[HI], metadata=[{}] * 1_001),
            None,
            "JSON objects and arrays, at most 1000",
            id="containers",
        ),
        pytest.param(
            "completion",
            body(prompt=[1] * 10_001),
            None,
            "10003 JSON items, at most 10000",
            id="items",
        ),
        pytest.param(
            "chat",
            body(messages=[HI], metadata=["a"] * 30_000),
            None,
            "more than 10000 JSON items",
            id="strings",
        ),
    ],
)
def test_a_body_past_a_bound_is_refused_naming_it(
    kind: RunKind, raw: bytes, param: str | None, words: str
) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_request(kind, raw, SMALL)
    assert words in str(caught.value)
    assert caught.value.param == param


def test_brackets_and_commas_inside_strings_do_not_count() -> None:
    code = 'if (x) { y[1] = {a: "b\\\\", c: [2, 3]}; }\n' * 2_000
    raw = body(messages=[{"role": "user", "content": code}, HI])
    assert raw.count(b"{") > SMALL.containers  # past the bound by the quick count
    check_structure(raw, SMALL)
    assert parse_request("chat", raw, SMALL).model == "m"
    tricky = body(messages=[{"role": "user", "content": 'say "{[," and \\"{{'}] * 40)
    check_structure(tricky * 1, BodyBounds(containers=1_000, items=10_000))


def test_a_flat_array_of_token_ids_is_one_prompt() -> None:
    assert parse_request("completion", body(prompt=[1] * 100), SMALL).model == "m"


def test_the_estimate_counts_every_part_the_model_reads() -> None:
    tools = [{"type": "function", "function": {"name": "f", "description": "x" * 4_000}}]
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "y" * 400}}]
    messages = [
        HI,
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "z" * 40},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "w" * 8},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 9000}},
            ],
        },
    ]
    raw = body(messages=messages, tools=tools)
    request = parse_request("chat", raw)
    text = len(orjson.dumps(tools)) + len(orjson.dumps(calls)) + len("c1") + 2 + 40 + 8
    assert estimate_tokens(request) == MEDIA_PART_TOKENS + -(-text // 4)
    assert estimate_tokens(request) > 1_000 + MEDIA_PART_TOKENS
    # The long-context class reads the same estimate: the tools alone make this request long.
    assert is_long(request, 1_000)
    assert not is_long(parse_request("chat", body(messages=messages[:1], tools=tools)), 2_000)
