"""Values survive the trip through protobuf; deadlines travel as time left."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from iop.edgeconfig import node_payloads
from iop.wire import RunChunk, RunDone, RunFailed, RunRequest, RunUsage
from iop.wire.converting import (
    event_from_proto,
    event_to_proto,
    payload_from_proto,
    payload_to_proto,
    request_from_proto,
    request_to_proto,
)

counts = st.integers(min_value=0, max_value=2**31)
events = st.one_of(
    st.builds(RunChunk, st.binary(), st.booleans()),
    st.builds(RunUsage, counts, counts, counts),
    st.builds(RunDone, st.one_of(st.none(), st.sampled_from(["stop", "length"]))),
    st.builds(
        RunFailed,
        st.sampled_from(["provider_busy", "upstream_error"]),
        st.text(),
        st.booleans(),
        st.one_of(st.none(), st.integers(min_value=400, max_value=599)),
    ),
)


@given(events)
def test_events_round_trip(event) -> None:
    message = event_to_proto("run-1", event)
    assert message.run_id == "run-1"
    assert event_from_proto(message) == event


@pytest.mark.parametrize("deadline", [None, 1_000.5, 990.0], ids=["none", "ahead", "past"])
def test_requests_round_trip_with_relative_deadlines(deadline: float | None) -> None:
    request = RunRequest("r", "p", "served", "completion", b'{"a":1}', True, deadline, True)
    message = request_to_proto(request, now=1_000.0)
    # The receiver's clock is 50 s ahead: the time left is what counts.
    back = request_from_proto(message, now=1_050.0)
    if deadline is None:
        assert back == request
    elif deadline > 1_000:
        assert back == RunRequest("r", "p", "served", "completion", b'{"a":1}', True, 1_050.5, True)
    else:
        assert back.deadline is not None and 1_050 < back.deadline < 1_050.001


def test_payloads_round_trip_with_their_digest(wire_config) -> None:
    config = wire_config(
        [
            {"id": "p1", "adapter": {"type": "fake", "latency_ms": 5}, "long_context_slots": 2},
            {"id": "p2", "adapter": {"type": "openai", "base_url": "http://127.0.0.1:1/v1"}},
        ]
    )
    payload = node_payloads(config)["node-1"]
    message = payload_to_proto(payload, generation=7)
    back, generation = payload_from_proto(message)
    assert (back, generation) == (payload, 7)
    assert message.config_hash == back.digest


def test_an_unreadable_adapter_is_a_clear_error(wire_config) -> None:
    config = wire_config([{"id": "p1", "adapter": {"type": "fake"}}])
    message = payload_to_proto(node_payloads(config)["node-1"], generation=1)
    message.providers[0].adapter_json = b"[1, 2"
    with pytest.raises(ValueError, match="provider 'p1': adapter settings are not JSON"):
        payload_from_proto(message)
