"""The body's structure bounds, its validation and the input-token estimate (no server)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from iop.edge.bodies import MEDIA_PART_TOKENS, estimate_tokens, is_long, parse_request
from iop.edge.bodybounds import BodyBounds, check_structure
from iop.edge.bodymodels import MODELS, bad_request, conforms
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


#: Values a checked field may hold: right ones, wrong types, out of bounds, bools for numbers.
_SCALARS: st.SearchStrategy[Any] = st.sampled_from(
    [None, True, False, 0, 1, 2, 128, 129, -1, 0.5, 1.0, 2.5, "", "a", "float", "base64", [], {}]
)
_PART = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"])}),
    st.dictionaries(st.sampled_from(["type", "text"]), _SCALARS, max_size=2),
    _SCALARS,
)
_CONTENT = st.one_of(_SCALARS, st.lists(_PART, max_size=3))
_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", ""]), "content": _CONTENT}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.just("hi")}),
    st.dictionaries(st.sampled_from(["role", "content", "name"]), _SCALARS, max_size=3),
    _SCALARS,
)
_PROMPT = st.one_of(
    _SCALARS,
    st.lists(st.sampled_from(["a", 1, True, 1.0, [1], [True], []]), max_size=3),
    st.lists(st.lists(st.sampled_from([1, 2, True, "a"]), max_size=2), max_size=3),
)
#: Right values of every checked field.
_GOOD = {
    "stream": st.booleans(),
    "stream_options": st.dictionaries(st.just("include_usage"), st.booleans(), max_size=1),
    "max_tokens": st.integers(1, 5),
    "max_completion_tokens": st.integers(1, 5),
    "temperature": st.sampled_from([0, 0.7, 2]),
    "top_p": st.sampled_from([0, 0.5, 1]),
    "n": st.sampled_from([1, 128]),
    "messages": st.lists(_MESSAGE, min_size=1, max_size=3),
    "prompt": _PROMPT,
    "input": _PROMPT,
    "encoding_format": st.sampled_from(["float", "base64"]),
    "dimensions": st.integers(1, 5),
    "user": st.just("u"),
}
#: What each kind of request asks (the models require one of them), in every document.
_ASKED = ("messages", "prompt", "input")
#: Anything in a field, right or wrong.
_ANY = {
    **{name: _SCALARS for name in ("model", *_GOOD)},
    "stream_options": st.one_of(
        _SCALARS, st.dictionaries(st.just("include_usage"), _SCALARS, max_size=1)
    ),
    "messages": st.one_of(_SCALARS, st.lists(_MESSAGE, max_size=3)),
}


@settings(max_examples=500, deadline=None)
@given(
    kind=st.sampled_from(["chat", "completion", "embedding"]),
    right=st.fixed_dictionaries(
        {"model": st.just("m"), **{name: _GOOD[name] for name in _ASKED}},
        optional={name: value for name, value in _GOOD.items() if name not in _ASKED},
    ),
    wrong=st.lists(
        st.sampled_from(sorted(_ANY)).flatmap(lambda name: st.tuples(st.just(name), _ANY[name])),
        max_size=2,
    ).map(dict),
)
def test_the_check_by_hand_accepts_only_what_the_models_accept(
    kind: RunKind, right: dict[str, Any], wrong: dict[str, Any]
) -> None:
    # The hand check decides most bodies alone: it must never let through one the models
    # refuse, and a body it does not vouch for gets the models' verdict (and their words).
    document = {**right, **wrong}
    raw = orjson.dumps(document)
    try:
        MODELS[kind].model_validate(orjson.loads(raw))
    except ValidationError as exc:
        with pytest.raises(BadRequest) as caught:
            parse_request(kind, raw)
        assert caught.value.param == bad_request(exc.errors(include_url=False)).param
        assert not conforms(kind, orjson.loads(raw))
    else:
        assert parse_request(kind, raw).model == document["model"]


@pytest.mark.parametrize(
    "document",
    [
        pytest.param({"messages": [HI]}, id="chat"),
        pytest.param({"messages": [{"role": "user", "content": "é" * 50}]}, id="utf-8"),
        pytest.param({"messages": [HI], "tools": [{"x": [1e15] * 20}]}, id="floats-re-encoded"),
        pytest.param({"prompt": [[1]] * 20}, id="token-ids"),
        pytest.param({"prompt": [1]}, id="one-token-id"),
        pytest.param(
            {"messages": [{"role": "user", "content": [{"type": "image_url"}] * 30}]},
            id="media-parts",
        ),
    ],
)
def test_the_bound_on_the_estimate_holds(document: dict[str, Any]) -> None:
    # A request below the long-context threshold by the bound is classed without the estimate.
    kind: RunKind = "chat" if "messages" in document else "completion"
    request = parse_request(kind, body(**document))
    assert request.most_tokens >= estimate_tokens(request)


@pytest.mark.parametrize("client", [{}, {"priority": -100}], ids=["none", "the-clients"])
def test_the_engine_priority_replaces_the_clients_and_goes_when_the_next_try_has_none(
    client: dict[str, Any],
) -> None:
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **client})
    request = parse_request("chat", raw)
    # A try on a server that schedules by priority gets the class's, never the client's ...
    assert orjson.loads(request.encode("served-a", -10))["priority"] == -10
    assert orjson.loads(request.encode("served-a", 0))["priority"] == 0
    # ... and a retry on one that does not gets the body as the client sent it.
    again = orjson.loads(request.encode("served-b"))
    assert again == {**orjson.loads(raw), "model": "served-b"}
