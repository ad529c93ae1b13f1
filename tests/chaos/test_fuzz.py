"""A bounded fuzz run over what outsiders send: OpenAI request bodies and admin API bodies.

Schema-driven: the bodies come from JSON schemas (OpenAI's chat and text completion requests, as
far as the Edge reads them, and the admin API's own pydantic models, `RefreshBody` and the whole
`EdgeConfig`), generated mostly right and often wrong in one place (a wrong type, a missing or
unknown field, an extreme number, deep nesting, odd text). Against a real Edge process and a
real Node, every answer must be below 500, every error OpenAI-shaped (or the admin API's shape),
and the Edge healthy afterwards. Bounded by examples and by a wall-clock budget per test.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iop.edge.http.adminapp import RefreshBody
from iop.edgeconfig import EdgeConfig
from testkit import CLIENT_TOKEN, node_token_of

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(180)]

#: Wall-clock budget of one fuzz test; examples past it pass without a request.
BUDGET_S = 40.0
EXAMPLES = 300

# -- schemas ---------------------------------------------------------------------------------------

_MESSAGE: dict[str, Any] = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"enum": ["system", "user", "assistant", "tool", "developer"]},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "null"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type"],
                        "properties": {
                            "type": {"enum": ["text", "image_url"]},
                            "text": {"type": "string"},
                        },
                    },
                },
            ]
        },
        "name": {"type": "string"},
    },
}
_SAMPLING: dict[str, Any] = {
    "model": {"enum": ["m", "not-a-model", ""]},
    "stream": {"type": "boolean"},
    "stream_options": {
        "type": "object",
        "properties": {"include_usage": {"type": "boolean"}},
    },
    "max_tokens": {"type": "integer", "minimum": -2, "maximum": 40},
    "max_completion_tokens": {"type": "integer", "minimum": 0, "maximum": 40},
    "temperature": {"type": "number", "minimum": -1, "maximum": 3},
    "top_p": {"type": "number", "minimum": -1, "maximum": 2},
    "n": {"type": "integer", "minimum": 0, "maximum": 3},
    "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "user": {"type": "string"},
    "metadata": {"type": "object"},
}
CHAT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {**_SAMPLING, "messages": {"type": "array", "items": _MESSAGE}},
}
COMPLETION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        **_SAMPLING,
        "prompt": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}},
                {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 50000}},
            ]
        },
    },
}

# -- strategies from a schema ----------------------------------------------------------------------

_JSON_LEAF = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
#: Any JSON value: what a field gets when it is generated wrong.
ANY_JSON = st.recursive(
    _JSON_LEAF,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _deep(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


#: Nesting around the depths where parsers and serializers stop (orjson: 255 out, 1024 in).
DEEP = st.sampled_from([200, 254, 256, 300, 1000, 1100]).map(_deep)


def from_schema(
    schema: dict[str, Any], defs: dict[str, Any] | None = None
) -> st.SearchStrategy[Any]:
    """Values for `schema` (a JSON-schema subset: type, enum, const, anyOf/oneOf, $ref, object
    properties and required, array items, numeric and length bounds), wrong now and then."""
    defs = defs if defs is not None else schema.get("$defs", {})
    return (
        st.one_of(_conforming(schema, defs), ANY_JSON)
        if _may_err(schema)
        else _conforming(schema, defs)
    )


def _may_err(schema: dict[str, Any]) -> bool:
    return "$ref" not in schema


def _conforming(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return st.deferred(lambda: from_schema(defs[name], defs))
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return st.one_of([from_schema(option, defs) for option in schema[key]])
    kind = schema.get("type")
    if kind == "object":
        return _object(schema, defs)
    if kind == "array":
        items = from_schema(schema.get("items", {}), defs) if schema.get("items") else ANY_JSON
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=3)
    if kind == "string":
        return st.text(max_size=schema.get("maxLength", 24))
    if kind == "integer":
        return st.integers(schema.get("minimum", -(2**40)), schema.get("maximum", 2**40))
    if kind == "number":
        return st.floats(schema.get("minimum", -1e9), schema.get("maximum", 1e9), allow_nan=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return ANY_JSON


def _object(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    properties: dict[str, Any] = schema.get("properties", {})
    if not properties:
        return st.dictionaries(st.text(max_size=8), ANY_JSON | DEEP, max_size=3)
    required = set(schema.get("required", []))
    fields = {name: from_schema(sub, defs) for name, sub in properties.items()}

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        document: dict[str, Any] = {}
        for name, strategy in fields.items():
            if name in required or draw(st.booleans()):
                document[name] = draw(strategy)
        if required and draw(st.integers(0, 9)) == 0:  # a required field missing
            document.pop(draw(st.sampled_from(sorted(required))), None)
        if draw(st.integers(0, 9)) == 0:  # an unknown field, or a deep one
            document[draw(st.text(max_size=10))] = draw(ANY_JSON | DEEP)
        return document

    return build()


# -- a real Edge and Node ----------------------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(tmp_path_factory, iop_processes, document_of) -> AsyncIterator[dict[str, Any]]:
    folder: Path = tmp_path_factory.mktemp("fuzz")
    document = document_of(
        [
            {
                "id": "p1",
                "adapter": {"type": "fake", "completion_tokens": 4},
                "served_models": ["served"],
                "capacity": 64,
            }
        ],
        edge={"admin": {"listen": "127.0.0.1:0", "config_dir": str(folder)}},
    )
    (folder / "edge.yaml").write_text(yaml.safe_dump(document))
    (folder / "node.token").write_text(node_token_of("node-1"))
    async with contextlib.AsyncExitStack() as stack:
        process, started = await iop_processes.edge(stack, folder / "edge.yaml")
        await iop_processes.node(stack, started["hub_port"], "node-1", folder / "node.token")
        await iop_processes.wait_available(started["url"], ["p1"])
        yield {**started, "document": document, "process": process, "folder": folder}


def as_yaml(value: Any) -> str:
    """`value` as YAML text; nesting past the dumper's reach as flow brackets instead."""
    try:
        return str(yaml.safe_dump(value))
    except RecursionError:
        return "a: " + "[" * 2000 + "]" * 2000


def budget() -> Callable[[], bool]:
    """True while the test's wall-clock budget lasts."""
    end = time.monotonic() + BUDGET_S
    return lambda: time.monotonic() < end


def assert_openai_error(response: httpx.Response) -> None:
    assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"]


def assert_healthy(stack: dict[str, Any]) -> None:
    assert stack["process"].returncode is None, "the Edge process died"
    with httpx.Client(base_url=stack["url"], timeout=30) as http:
        assert http.get("/healthz").status_code == 200
        answer = http.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "still there?"}]},
            headers={"authorization": f"Bearer {CLIENT_TOKEN}"},
        )
        assert answer.status_code == 200, answer.text


_FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
)


def test_openai_request_bodies(stack) -> None:
    within = budget()
    client = httpx.Client(
        base_url=stack["url"], timeout=30, headers={"authorization": f"Bearer {CLIENT_TOKEN}"}
    )

    @_FUZZ
    @given(
        st.sampled_from(["/v1/chat/completions", "/v1/completions"]).flatmap(
            lambda path: st.tuples(
                st.just(path),
                from_schema(CHAT_SCHEMA if "chat" in path else COMPLETION_SCHEMA),
            )
        )
    )
    def post(request: tuple[str, Any]) -> None:
        if not within():
            return
        path, body = request
        assert_openai_error(client.post(path, json=body))

    with client:
        post()
    assert_healthy(stack)


def test_admin_refresh_bodies(stack) -> None:
    within = budget()
    refresh_schema = RefreshBody.model_json_schema()
    config_schema = EdgeConfig.model_json_schema()
    folder: Path = stack["folder"]
    (folder / "notes.yaml").write_text("just: notes\n")
    paths = st.sampled_from(
        [str(folder / "edge.yaml"), str(folder / "notes.yaml"), "/etc/passwd", "../x", "a\x00b"]
    ) | st.text(max_size=30)
    bodies = st.fixed_dictionaries(
        {"mode": from_schema(refresh_schema["properties"]["mode"])},
        optional={
            "config": from_schema(config_schema),
            "config_yaml": st.text(max_size=200) | from_schema(config_schema).map(as_yaml),
            "path": paths,
        },
    )
    client = httpx.Client(base_url=stack["admin_url"], timeout=30)

    @_FUZZ
    @given(bodies | ANY_JSON)
    def post(body: Any) -> None:
        if not within():
            return
        response = client.post("/refresh", json=body)
        assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
        document = response.json()
        if response.status_code in (400, 401, 404, 405, 413):
            assert set(document["error"]) == {"code", "message", "param", "type"}
        else:
            assert document["outcome"] in ("applied", "valid", "restart_required", "invalid")

    with client:
        post()
        # Whatever was applied, the original config goes back, and the Edge serves with it.
        restored = client.post("/refresh", json={"mode": "apply", "config": stack["document"]})
        assert restored.status_code == 200, restored.text
    assert_healthy(stack)
