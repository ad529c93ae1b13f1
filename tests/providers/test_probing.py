"""Active health checks against a real fake upstream on loopback, and the runner's verdicts:
probes take a dead upstream out and bring it back, failing real runs take it out at once."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest

from iop.edgeconfig import node_payloads, parse_policy
from iop.fakes import FakeUpstream, FakeUpstreamSettings
from iop.providers import Runner
from iop.providers.probing import Prober, ProbeTarget, probe_url
from iop.wire import ProviderHealth, RunEvent, RunFailed, RunRequest, nodestates

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


@pytest.mark.parametrize(
    ("base_url", "path", "expected"),
    [
        pytest.param("http://h:8000/v1", None, "http://h:8000/v1/models", id="default"),
        pytest.param("http://h:8000/v1/", None, "http://h:8000/v1/models", id="trailing-slash"),
        pytest.param("http://h:8000/v1", "/health", "http://h:8000/health", id="own-path"),
        pytest.param("https://u:p@h/openai/v1", "/ready", "https://u:p@h/ready", id="userinfo"),
    ],
)
def test_what_a_probe_gets(base_url: str, path: str | None, expected: str) -> None:
    assert probe_url(base_url, path) == expected


def test_the_shown_url_carries_no_credentials() -> None:
    target = ProbeTarget("p1", "https://user:secret@h:8443/health", 1.0, 1.0, {"x": "key"})
    assert target.shown_url == "https://h:8443/health"
    assert "key" not in repr(target)


def target(url: str, timeout: float = 2.0) -> ProbeTarget:
    return ProbeTarget("p1", url, 1.0, timeout)


@pytest.fixture
async def prober() -> AsyncIterator[Prober]:
    prober = Prober(lambda provider_id, failure: None)
    yield prober
    await prober.aclose()


async def test_a_probe_passes_on_an_answer_and_fails_on_an_error_status(
    prober: Prober, fake_upstream: FakeUpstream
) -> None:
    assert await prober.probe(target(f"{fake_upstream.base_url}/models")) is None
    assert await prober.probe(target(f"http://{fake_upstream.address}/health")) is None
    failure = await prober.probe(target(f"http://{fake_upstream.address}/nope"))
    assert failure == f"GET http://{fake_upstream.address}/nope answered HTTP 404"
    assert fake_upstream.stats.lookups == 2


async def test_a_probe_reaches_only_addresses_the_upstream_policy_allows(
    fake_upstream: FakeUpstream,
) -> None:
    """`localhost` is listed by name, and resolves to loopback, which only a CIDR lets in."""
    url = f"http://localhost:{fake_upstream.port}/v1/models"
    guarded = Prober(lambda provider_id, failure: None, policy=parse_policy("allow: [localhost]"))
    try:
        failure = await guarded.probe(target(url))
    finally:
        await guarded.aclose()
    assert failure is not None
    assert "localhost (127.0.0.1) is in a range the upstream policy denies" in failure, failure
    assert fake_upstream.stats.connections == 0
    opened = Prober(lambda p, f: None, policy=parse_policy("allow: [127.0.0.1/32, localhost]"))
    try:
        assert await opened.probe(target(url)) is None
    finally:
        await opened.aclose()


async def test_a_probe_of_a_closed_port_says_connection_refused(prober: Prober) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    failure = await prober.probe(target(f"http://127.0.0.1:{port}/v1/models"))
    assert failure == f"cannot connect to http://127.0.0.1:{port}/v1/models: Connection refused"


async def test_a_probe_of_a_server_that_never_answers_times_out(prober: Prober) -> None:
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        failure = await prober.probe(target(f"http://127.0.0.1:{port}/v1/models", timeout=0.2))
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()
    assert failure == f"no answer from GET http://127.0.0.1:{port}/v1/models within 0.2s"


# -- the runner's verdicts -----------------------------------------------------------------------

FAST = {"interval_ms": 100, "timeout_ms": 500, "failure_threshold": 2, "success_threshold": 2}
BODY = orjson.dumps({"model": "served", "messages": [{"role": "user", "content": "hi"}]})


class Verdicts:
    """What a runner told its health listeners about p1, in order."""

    def __init__(self, runner: Runner) -> None:
        self.seen: list[ProviderHealth] = []
        runner.add_health_listener(self._heard)

    def _heard(self, health: list[ProviderHealth]) -> None:
        self.seen += [h for h in health if h.provider_id == "p1"]

    @property
    def last(self) -> ProviderHealth:
        return self.seen[-1]

    def reasons(self) -> list[str]:
        """The reasons in order, repeats folded (a swap reports every provider again)."""
        folded: list[str] = []
        for health in self.seen:
            reason = health.reason or "healthy"
            if not folded or folded[-1] != reason:
                folded.append(reason)
        return folded


def openai_payload(wire_config: Callable[..., Any], base_url: str, **health: Any) -> Any:
    provider = {
        "id": "p1",
        "adapter": {"type": "openai", "base_url": base_url, "connect_timeout_s": 1},
        "health": {**FAST, **health},
    }
    return node_payloads(wire_config([provider]))["node-1"]


async def test_probes_take_a_dead_upstream_out_and_bring_it_back(wire_config, until) -> None:
    upstream = FakeUpstream()
    port = await upstream.start()
    runner = Runner(drain_timeout=1)
    verdicts = Verdicts(runner)
    try:
        runner.apply(openai_payload(wire_config, upstream.base_url))
        assert verdicts.last.reason == nodestates.NOT_PROBED
        await until(lambda: verdicts.last.healthy)
        await upstream.stop()
        await until(lambda: not verdicts.last.healthy)
        assert verdicts.last.reason == nodestates.PROBE_FAILED
        assert "Connection refused" in verdicts.last.detail
        upstream = FakeUpstream(port=port)
        await upstream.start()
        await until(lambda: verdicts.last.healthy)
    finally:
        await runner.aclose()
        await upstream.stop()
    assert verdicts.reasons() == ["not_probed", "healthy", "probe_failed", "healthy"]
    assert runner.prober.targets == {}


async def test_failing_runs_take_a_provider_out_and_probes_bring_it_back(
    wire_config, until
) -> None:
    """The upstream answers its probes but fails every completion (HTTP 500): outlier
    detection takes it out after the threshold, and passing probes bring it back."""
    settings = FakeUpstreamSettings(fail_rate=1.0, error_status=500)
    async with FakeUpstream(settings) as upstream:
        runner = Runner(drain_timeout=1)
        verdicts = Verdicts(runner)
        payload = openai_payload(wire_config, upstream.base_url, request_failure_threshold=3)
        try:
            runner.apply(payload)
            await until(lambda: verdicts.last.healthy)
            outcomes: list[RunEvent] = []
            for index in range(3):
                request = RunRequest(f"r{index}", "p1", "served", "chat", BODY, False)
                provision = runner.admit(request)
                assert not isinstance(provision, RunFailed)
                await runner.execute(runner.run_events(request, provision), outcomes.append)
            assert all(isinstance(o, RunFailed) and o.status == 500 for o in outcomes)
            assert verdicts.last.reason == nodestates.REQUEST_FAILURES  # at once, no probe
            assert verdicts.last.detail.startswith("3 request(s) in a row failed on the upstream")
            await until(lambda: verdicts.last.healthy)  # two passing probes
        finally:
            await runner.aclose()
    assert verdicts.reasons() == ["not_probed", "healthy", "request_failures", "healthy"]


async def test_a_pushed_policy_retunes_the_probes_and_fake_adapters_are_never_probed(
    wire_config,
) -> None:
    runner = Runner(drain_timeout=1)
    try:
        runner.apply(openai_payload(wire_config, "http://127.0.0.1:9/v1"))
        assert runner.prober.targets["p1"].interval == 0.1
        runner.apply(openai_payload(wire_config, "http://127.0.0.1:9/v1", interval_ms=300))
        assert runner.prober.targets["p1"].interval == 0.3
        runner.apply(openai_payload(wire_config, "http://127.0.0.1:9/v1", interval_ms=0))
        assert runner.prober.targets == {}
        assert runner.health() == [ProviderHealth("p1", True)]
        fake = [{"id": "p1", "adapter": {"type": "fake"}, "health": FAST}]
        runner.apply(node_payloads(wire_config(fake))["node-1"])
        assert runner.prober.targets == {}
        assert runner.health() == [ProviderHealth("p1", True)]
    finally:
        await runner.aclose()
