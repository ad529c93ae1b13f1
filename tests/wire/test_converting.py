"""Values survive the trip through protobuf; deadlines travel as time left."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from iop.edgeconfig import HealthPolicy, node_payloads
from iop.wire import (
    DrainProgress,
    ProviderHealth,
    RunChunk,
    RunDone,
    RunFailed,
    RunRequest,
    RunUsage,
    nodestates,
)
from iop.wire import runtime_pb2 as pb
from iop.wire.converting import (
    ack_from_proto,
    chunk_to_pieces,
    drain_from_proto,
    drain_to_proto,
    event_from_proto,
    event_to_proto,
    health_from_proto,
    health_to_proto,
    liveness_from_proto,
    liveness_to_proto,
    payload_from_proto,
    payload_to_proto,
    request_from_proto,
    request_to_proto,
    server_load_from_proto,
    server_load_to_proto,
)
from iop.wire.liveness import DEFAULT_LIVENESS, Liveness
from iop.wire.texts import MAX_ID_CHARS, MAX_TEXT_CHARS, bounded

counts = st.integers(min_value=0, max_value=2**31)
events = st.one_of(
    st.builds(RunChunk, st.binary(), st.booleans(), st.booleans()),
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


@pytest.mark.parametrize(
    "kind",
    [
        "chat",
        "completion",
        "embedding",
        "response",
        "response_retrieve",
        "response_delete",
        "response_cancel",
    ],
)
def test_every_kind_round_trips_with_its_response_id(kind) -> None:
    request = RunRequest("r", "p", "served", kind, b"", False, response_id="resp_1")
    assert request_from_proto(request_to_proto(request)) == request


def test_payloads_round_trip_with_their_digest(wire_config) -> None:
    config = wire_config(
        [
            {"id": "p1", "adapter": {"type": "fake", "latency_ms": 5}, "long_context_slots": 2},
            {"id": "p2", "adapter": {"type": "openai", "base_url": "http://127.0.0.1:1/v1"}},
            {
                "id": "p3",
                "adapter": {"type": "openai", "base_url": "http://127.0.0.1:2/v1"},
                "health": {"path": "/health", "interval_ms": 0, "request_failure_threshold": 0},
            },
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


def test_a_payload_without_health_policies_is_the_defaults(wire_config) -> None:
    """What an Edge that predates health policies sends: the Node uses the defaults."""
    config = wire_config([{"id": "p1", "adapter": {"type": "fake"}}])
    message = payload_to_proto(node_payloads(config)["node-1"], generation=1)
    assert not message.providers[0].HasField("health")
    payload, _ = payload_from_proto(message)
    assert payload.providers[0].health_policy == HealthPolicy()
    assert message.config_hash == payload.digest


def test_an_invalid_health_policy_is_a_clear_error(wire_config) -> None:
    config = wire_config([{"id": "p1", "adapter": {"type": "fake"}, "health": {"path": "/h"}}])
    message = payload_to_proto(node_payloads(config)["node-1"], generation=1)
    message.providers[0].health.failure_threshold = 0
    with pytest.raises(ValueError, match="provider 'p1': invalid health policy: failure_thr"):
        payload_from_proto(message)


@pytest.mark.parametrize(
    "health",
    [
        pytest.param(ProviderHealth("p1", True), id="healthy"),
        pytest.param(
            ProviderHealth("p1", False, "3 probes failed", nodestates.PROBE_FAILED), id="reason"
        ),
    ],
)
def test_health_round_trips_with_its_reason(health: ProviderHealth) -> None:
    assert health_from_proto(health_to_proto(health)) == health


def test_health_from_a_node_without_reasons_has_none() -> None:
    message = pb.ProviderHealth(provider_id="p1", healthy=False, detail="draining")
    assert health_from_proto(message) == ProviderHealth("p1", False, "draining", "")


@pytest.mark.parametrize(
    "progress",
    [
        pytest.param(DrainProgress(), id="none"),
        pytest.param(DrainProgress(False, {"p1": 2}), id="swap"),
        pytest.param(DrainProgress(True, {"p1": 1, "p2": 3}), id="shutdown"),
        pytest.param(DrainProgress(True, {}), id="shutdown-done"),
    ],
)
def test_drain_progress_round_trips(progress: DrainProgress) -> None:
    back = drain_from_proto(drain_to_proto(progress))
    assert (back.shutting_down, dict(back.runs_left)) == (
        progress.shutting_down,
        dict(progress.runs_left),
    )
    assert back.draining == progress.draining


@pytest.mark.parametrize("sse", [False, True], ids=["object", "sse-events"])
def test_a_chunk_larger_than_a_piece_travels_in_pieces_that_join_to_it(sse: bool) -> None:
    data = bytes(range(256)) * 40  # 10,240 bytes
    pieces = chunk_to_pieces("r", RunChunk(data, usage_only=True, sse=sse), 4096)
    assert [len(p.chunk.data) for p in pieces] == [4096, 4096, 2048]
    assert [p.chunk.more for p in pieces] == [True, True, False]
    assert all(p.run_id == "r" and p.chunk.usage_only and p.chunk.sse is sse for p in pieces)
    assert b"".join(p.chunk.data for p in pieces) == data


def test_a_stream_asks_for_sse_chunks_and_a_node_that_predates_it_reads_none() -> None:
    request = RunRequest("r", "p", "served", "chat", b"{}", True, sse_chunks=True)
    assert request_from_proto(request_to_proto(request)).sse_chunks
    assert not request_from_proto(pb.RunRequest(run_id="r", kind=pb.RUN_KIND_CHAT)).sse_chunks


def test_what_a_node_says_in_words_is_cut_before_anyone_keeps_it() -> None:
    huge = "x" * 20 * 1024 * 1024
    event = event_from_proto(
        pb.RunEvent(run_id="r", error=pb.RunError(code=huge, message=huge, retryable=False))
    )
    assert isinstance(event, RunFailed)
    assert len(event.message) < MAX_TEXT_CHARS + 100 and event.message.endswith("cut)")
    assert len(event.code) < MAX_ID_CHARS + 100
    health = health_from_proto(pb.ProviderHealth(provider_id="p", detail=huge, reason=huge))
    assert len(health.detail) < MAX_TEXT_CHARS + 100 and len(health.reason) < MAX_ID_CHARS + 100
    ack = ack_from_proto(
        pb.ConfigAck(generation=3, config_hash=huge, error=huge, pending=True, in_use_hash=huge)
    )
    assert (ack.generation, ack.ok, ack.pending) == (3, False, True)
    assert len(ack.error) < MAX_TEXT_CHARS + 100
    assert len(ack.config_hash) < MAX_ID_CHARS + 100 and len(ack.in_use_hash) < MAX_ID_CHARS + 100
    assert bounded("short") == "short"


def test_a_run_carries_its_answer_bound_and_zero_means_the_default() -> None:
    request = RunRequest("r", "p", "served", "chat", b"{}", False, max_response_bytes=12345)
    assert request_from_proto(request_to_proto(request)).max_response_bytes == 12345
    unbounded = request_to_proto(RunRequest("r", "p", "served", "chat", b"{}", False))
    assert unbounded.max_response_bytes == 0
    assert request_from_proto(unbounded).max_response_bytes is None


def test_liveness_with_quiet_links_round_trips_and_an_edge_that_predates_them_offers_none() -> None:
    quiet = Liveness(0.5, 2.0, 5.0, 20.0)
    assert liveness_from_proto(liveness_to_proto(quiet), DEFAULT_LIVENESS) == quiet
    older = pb.Liveness(heartbeat_interval_ms=500, heartbeat_timeout_ms=2000)  # no idle fields
    taken = liveness_from_proto(older, DEFAULT_LIVENESS)
    assert (taken, taken.quiet, taken.timeout(quiet=True)) == (Liveness(0.5, 2.0), False, 2.0)
    # Idle values that make no sense are dropped, the fast ones kept.
    odd = pb.Liveness(
        heartbeat_interval_ms=500, heartbeat_timeout_ms=2000, idle_interval_ms=9, idle_timeout_ms=1
    )
    assert liveness_from_proto(odd, DEFAULT_LIVENESS) == Liveness(0.5, 2.0)


def test_a_servers_adapters_round_trip_and_an_old_nodes_load_has_none() -> None:
    load = nodestates.ServerLoad(
        3, 1, 0.5, 0.25, 2, ("sql-lora", "chat-lora"), ("law-lora",), max_loras=2
    )
    assert server_load_from_proto(server_load_to_proto(load)) == load
    old = pb.ServerLoad(running=3, waiting=1)  # a Node that predates adapters
    assert server_load_from_proto(old) == nodestates.ServerLoad(3, 1)


def test_a_servers_adapter_lists_are_bounded() -> None:
    many = [f"a{i}" for i in range(nodestates.MAX_ADAPTERS + 10)]
    load = server_load_from_proto(pb.ServerLoad(running_adapters=many, waiting_adapters=many))
    assert len(load.running_adapters) == len(load.waiting_adapters) == nodestates.MAX_ADAPTERS
