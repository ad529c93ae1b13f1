"""The Responses API's request bodies: validation naming the field, the structure bounds, the
generation policy and the input-token estimate (no server)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from iop.edge.bodies import MEDIA_PART_TOKENS, apply_policy, estimate_tokens, parse_request
from iop.edge.bodybounds import BodyBounds
from iop.edge.bodymodels import ResponseBody, conforms, input_problem
from iop.edge.errors import BadRequest
from iop.edge.pool.prefixes import prefix_key
from iop.edgeconfig import GenerationPolicy

SMALL = BodyBounds(containers=1_000, items=10_000, depth=8, messages=50, content_parts=4, inputs=8)
USER = {"role": "user", "content": "hello"}


def body(**fields: Any) -> bytes:
    return orjson.dumps({"model": "m", **fields})


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        pytest.param({}, "input", id="missing-input"),
        pytest.param({"input": 7}, "input", id="input-number"),
        pytest.param({"input": ["x"]}, "input[0]", id="item-not-object"),
        pytest.param({"input": [{"content": "x"}]}, "input[0]", id="item-without-role-or-type"),
        pytest.param({"input": [{"role": ""}]}, "input[0].role", id="empty-role"),
        pytest.param({"input": [{"type": 3}]}, "input[0].type", id="type-number"),
        pytest.param(
            {"input": [USER, {"role": "user", "content": 5}]}, "input[1].content", id="content"
        ),
        pytest.param(
            {"input": [{"role": "user", "content": [{"type": "input_text"}, {"text": "x"}]}]},
            "input[0].content[1]",
            id="part-without-type",
        ),
        pytest.param({"input": "x", "max_output_tokens": "12"}, "max_output_tokens", id="max-str"),
        pytest.param({"input": "x", "max_output_tokens": 0}, "max_output_tokens", id="max-zero"),
        pytest.param({"input": "x", "temperature": 2.5}, "temperature", id="temperature"),
        pytest.param({"input": "x", "top_p": -1}, "top_p", id="top-p"),
        pytest.param({"input": "x", "stream": "yes"}, "stream", id="stream"),
        pytest.param({"input": "x", "instructions": 1}, "instructions", id="instructions"),
        pytest.param(
            {"input": "x", "previous_response_id": 1}, "previous_response_id", id="previous"
        ),
        pytest.param({"input": "x", "store": "no"}, "store", id="store"),
        pytest.param({"input": "x", "model": ""}, "model", id="model"),
    ],
)
def test_a_wrong_field_is_named(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as refused:
        parse_request("response", body(**fields))
    assert refused.value.param == param
    assert f"'{param}'" in refused.value.message


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        pytest.param({"input": [USER] * 9}, "input", "9 items, at most 8", id="items"),
        pytest.param(
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}] * 5}]},
            "input[0].content",
            "5 items, at most 4",
            id="parts",
        ),
    ],
)
def test_the_bulk_is_bounded(fields: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(BadRequest, match=words) as refused:
        parse_request("response", body(**fields), SMALL)
    assert refused.value.param == param


def test_a_continuation_is_read_and_the_body_forwarded_as_sent() -> None:
    raw = body(input=[USER], previous_response_id="resp_1", stream=True, store=True, extra={"a": 1})
    request = parse_request("response", raw)
    assert (request.kind, request.stream, request.previous_response_id) == (
        "response",
        True,
        "resp_1",
    )
    assert not request.include_usage
    assert orjson.loads(request.encode("served")) == {**orjson.loads(raw), "model": "served"}


def test_the_policy_caps_max_output_tokens() -> None:
    policy = GenerationPolicy(max_tokens=8, temperature=0.5)
    capped = parse_request("response", body(input="x", max_output_tokens=100))
    apply_policy(capped, policy)
    assert capped.document["max_output_tokens"] == 8 and capped.document["temperature"] == 0.5
    named_none = parse_request("response", body(input="x"))
    apply_policy(named_none, policy)
    assert named_none.document["max_output_tokens"] == 8
    assert "max_tokens" not in named_none.document


def test_the_estimate_reads_instructions_input_and_tools() -> None:
    request = parse_request(
        "response",
        body(
            instructions="a" * 40,
            input=[
                {"role": "user", "content": "b" * 40},
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "c" * 40},
                        {"type": "input_image", "image_url": "https://x"},
                        {"type": "input_file", "file_id": "f"},
                    ],
                },
                {"type": "function_call_output", "call_id": "c1", "output": "d" * 32},
            ],
            tools=[{"type": "function", "name": "f"}],
        ),
    )
    tools = len(orjson.dumps([{"type": "function", "name": "f"}]))
    text = 40 + 40 + 40 + len("c1") + 32 + tools
    assert estimate_tokens(request) == 2 * MEDIA_PART_TOKENS + -(-text // 4)
    assert request.most_tokens >= estimate_tokens(request)


def test_the_prefix_is_a_chats_with_the_instructions_as_system() -> None:
    as_text = parse_request("response", body(instructions="sys", input="hello"))
    as_items = parse_request("response", body(instructions="sys", input=[USER]))
    key = prefix_key(as_text)
    assert key is not None and key == prefix_key(as_items)
    longer = parse_request(
        "response", body(instructions="sys", input=[USER, {"role": "assistant", "content": "x"}])
    )
    longer_key = prefix_key(longer)
    assert longer_key is not None and longer_key.points[0] == key.points[0]


_PART = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["input_text", "input_image"])}),
    st.fixed_dictionaries({"text": st.just("x")}),
    st.just("x"),
)
_ITEM = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from(["user", "", 1]),
            "type": st.sampled_from(["message", "function_call_output", None]),
            "content": st.one_of(st.just("x"), st.just(5), st.lists(_PART, max_size=2)),
        },
    ),
    st.just("x"),
)
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-1, 3), st.just("x"), st.just(0.5))


@settings(max_examples=300, deadline=None)
@given(
    document=st.fixed_dictionaries(
        {
            "model": st.sampled_from(["m", ""]),
            "input": st.one_of(st.just("x"), st.lists(_ITEM, max_size=3), _VALUES),
        },
        optional={
            name: _VALUES
            for name in (
                "stream",
                "instructions",
                "max_output_tokens",
                "temperature",
                "top_p",
                "previous_response_id",
                "store",
                "background",
            )
        },
    )
)
def test_the_check_by_hand_accepts_only_what_the_rules_accept(document: dict[str, Any]) -> None:
    try:
        ResponseBody.model_validate(document)
        valid = input_problem(document["input"]) is None
    except ValidationError:
        valid = False
    if valid:
        assert parse_request("response", orjson.dumps(document)).model == "m"
    else:
        assert not conforms("response", document)
        with pytest.raises(BadRequest):
            parse_request("response", orjson.dumps(document))
