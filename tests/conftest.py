"""Fixtures shared across test areas: the runtime wire's real servers on port 0.

`document_of(...)` and `config_of(...)` build a config document (testkit's builder, with the
tests' TLS) and an EdgeConfig; `wire_config(...)` builds one for the wire tests; `fake_upstream`
is a real fake OpenAI server on a loopback socket; `start_hub` and `start_node` start the Edge's
node hub and an in-process Node agent and stop them when the test ends. `no_leaked_tasks` fails
a test that leaves an asyncio task behind (wire tests use it through `pytestmark`).
`start_edge` starts a whole in-process Edge with its admin API, for the live refresh tests;
`iop_processes` starts real `iop edge run` / `iop node run` processes. `redis_url` is a real
Redis server (Debian's `redis-server`, installed with apt-get when missing, as the e2e cluster
installs its host packages) for the shared limit store, one per session.

Every Node link in the tests runs over mutual TLS, as deployed: a CA, a server certificate for
loopback and a client certificate are made once per session (`TEST_TLS`, with `cryptography`;
no key is ever committed), every built config carries `edge.tls`, and every Node, in-process or
a process, dials with them.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import datetime
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from hypothesis import HealthCheck, settings

from iop.edge import EdgeServer
from iop.edge.hub.nodehub import NodeHub
from iop.edgeconfig import EdgeConfig, load_data
from iop.fakes import FakeUpstream, FakeUpstreamSettings
from iop.node import NodeAgent
from iop.processes import free_port, share_ports, spawn_edge, spawn_node, terminate
from iop.wire import ClientTls
from testkit import CLIENT_TOKEN, CLIENTS, edge_document, node_token_of, provider
from tests.waiting import wait_available, wait_for, wait_until

# Hypothesis' per-example deadline measures the machine, not the code: on a loaded 2-core CI
# runner a fast example can take a second. The properties bound their work by example counts.
settings.register_profile("iop", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("iop")


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is not None:  # the ports `free_port` picks: never those of another worker
        share_ports(int(worker.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))


NODE_TOKEN = node_token_of("node-1")
#: The OpenAI API keys every built config knows: token_ref -> raw key (principal team-search).
CLIENT_TOKENS = {client.token_ref: client.key for client in CLIENTS}


# -- TLS on the Node links: certificates made at test time ---------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    """A test CA, the Edge's certificate (for localhost and loopback IPs) and a Node's."""

    folder: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def edge_section(self, *, mutual: bool = True) -> dict[str, str]:
        """`edge.tls` of a config: server TLS, and mutual TLS unless `mutual=False`."""
        section = {"cert_file": str(self.server_cert), "key_file": str(self.server_key)}
        if mutual:
            section["client_ca_file"] = str(self.ca)
        return section

    def client(self) -> ClientTls:
        """How a Node dials an Edge of `edge_section()`."""
        return ClientTls(str(self.ca), str(self.client_cert), str(self.client_key))

    def node_args(self) -> tuple[str, ...]:
        """The `iop node run` flags of `client()`."""
        return (
            *("--tls-ca-file", str(self.ca)),
            *("--tls-cert-file", str(self.client_cert), "--tls-key-file", str(self.client_key)),
        )


def make_tls_files(folder: Path) -> TlsFiles:
    """A fresh CA and two certificates it signed, as PEM files in `folder` (keys mode 0600)."""
    now = datetime.datetime.now(datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        path.chmod(0o600)
        return path

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(name("iop test CA"))
        .issuer_name(name("iop test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )

    def issue(common: str, usage: x509.ObjectIdentifier, sans: list[x509.GeneralName]) -> Any:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(common))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return key, builder.sign(ca_key, hashes.SHA256())

    loopback: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
    ]
    server_key, server_cert = issue("iop edge", ExtendedKeyUsageOID.SERVER_AUTH, loopback)
    client_key, client_cert = issue("iop node", ExtendedKeyUsageOID.CLIENT_AUTH, [])

    def write_cert(cert: x509.Certificate, path: Path) -> Path:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return path

    return TlsFiles(
        folder=folder,
        ca=write_cert(ca_cert, folder / "ca.pem"),
        server_cert=write_cert(server_cert, folder / "edge.pem"),
        server_key=write_key(server_key, folder / "edge-key.pem"),
        client_cert=write_cert(client_cert, folder / "node.pem"),
        client_key=write_key(client_key, folder / "node-key.pem"),
    )


def _session_tls() -> TlsFiles:
    folder = Path(tempfile.mkdtemp(prefix="iop-test-tls-"))
    # Removed when this process exits: every process that loads this file makes one (pytest-xdist's
    # controller, and workers that run only end-to-end tests, run no session fixture here).
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return make_tls_files(folder)


#: The process's test certificates (removed when it exits).
TEST_TLS = _session_tls()


@pytest.fixture(scope="session")
def tls() -> TlsFiles:
    """The session's test CA and certificates (`TEST_TLS`)."""
    return TEST_TLS


@pytest.fixture(scope="session")
def tls_factory() -> Callable[[Path], TlsFiles]:
    """`tls_factory(folder)`: another CA and certificates, in `folder` (`make_tls_files`)."""
    return make_tls_files


def build_document(
    providers: Sequence[Mapping[str, Any]] = (),
    models: Mapping[str, Sequence[str]] | None = None,
    *,
    node_id: str = "node-1",
    token: str | None = None,
    nodes: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    threshold: int = 1000,
    openai: Mapping[str, Any] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """The config builder (`testkit.edge_document`) with the tests' defaults: a document with one
    node, `node_id`, holding `providers` (its token `token`, else `node_token_of(node_id)`), or
    with `nodes` (node id -> providers); the Node link is mutual TLS with `TEST_TLS` (unless
    `tls=None`), and `threshold` is the long-context threshold. `models` and `options` go to the
    builder (`model_settings`, `placement`, `admin`, `metrics`, `clients`, `edge`, ...).
    """
    if nodes is None:
        nodes = {node_id: providers}
    if token is not None:
        options["node_tokens"] = {node_id: token}
    options.setdefault("tls", TEST_TLS.edge_section())
    openai = {"long_context_threshold_tokens": threshold, **(openai or {})}
    return edge_document(nodes, models, openai=openai, **options)


def build_config(providers: list[dict[str, Any]], *args: Any, **options: Any) -> EdgeConfig:
    """`build_document(...)`, loaded."""
    return load_data(build_document(providers, *args, **options))


def build_wire_config(providers: list[dict[str, Any]], **options: Any) -> EdgeConfig:
    """For wire tests: every provider serves "served" (capacity 8), one model `m-<id>` each."""
    full = [{"served_models": ["served"], "capacity": 8, **entry} for entry in providers]
    return build_config(full, {f"m-{p['id']}": [p["id"]] for p in full}, **options)


@pytest.fixture(scope="session")
def document_of() -> Callable[..., dict[str, Any]]:
    """`document_of(providers, models, ...)`: `build_document`, the builder with the tests'
    defaults."""
    return build_document


@pytest.fixture(scope="session")
def config_of() -> Callable[..., EdgeConfig]:
    """`config_of(providers, models, threshold=..., openai=..., ...)`: `build_config`."""
    return build_config


@pytest.fixture(scope="session")
def tokens() -> dict[str, str]:
    """The OpenAI API keys every built config knows (`CLIENT_TOKENS`)."""
    return dict(CLIENT_TOKENS)


@pytest.fixture
def wire_config() -> Callable[..., EdgeConfig]:
    """`wire_config(providers, node_id=..., token=...)`: see `build_wire_config`."""
    return build_wire_config


@pytest.fixture
async def no_leaked_tasks() -> AsyncIterator[None]:
    before = asyncio.all_tasks()
    yield
    loop = asyncio.get_running_loop()
    until = loop.time() + 0.5  # closing sockets and finalizing generators take a few turns
    while True:
        await asyncio.sleep(0.01)
        leaked = [
            t
            for t in asyncio.all_tasks() - before
            if t is not asyncio.current_task() and not t.done()
        ]
        if not leaked or loop.time() > until:
            break
    assert not leaked, f"tasks leaked out of the test: {[t.get_name() for t in leaked]}"


@pytest.fixture
async def fake_upstream() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(FakeUpstreamSettings()) as upstream:
        yield upstream


@pytest.fixture
async def start_hub() -> AsyncIterator[Callable[[EdgeConfig], Awaitable[NodeHub]]]:
    async with contextlib.AsyncExitStack() as stack:

        async def start(config: EdgeConfig) -> NodeHub:
            return await stack.enter_async_context(NodeHub(config))

        yield start


@pytest.fixture
async def start_node() -> AsyncIterator[Callable[..., Awaitable[NodeAgent]]]:
    """`await start_node(*hubs, token=..., **agent_options)`: a Node connected to the hubs."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(*hubs: NodeHub, wait: bool = True, **options: Any) -> NodeAgent:
            options.setdefault("node_id", "node-1")
            options.setdefault("token", NODE_TOKEN)
            options.setdefault("tls", TEST_TLS.client())
            options.setdefault("backoff_initial", 0.05)
            options.setdefault("backoff_max", 0.5)
            agent = NodeAgent(edges=[f"127.0.0.1:{hub.port}" for hub in hubs], **options)
            await stack.enter_async_context(agent)
            if wait:
                for hub in hubs:
                    await wait_until(hub.connected_providers)
            return agent

        yield start


@pytest.fixture
def until() -> Callable[..., Awaitable[Any]]:
    """`await until(lambda: condition, timeout=10)`: see `wait_until`."""
    return wait_until


@pytest.fixture
def node_token() -> str:
    return NODE_TOKEN


# -- live refresh: an in-process Edge (with its admin API) and its documents --------------------


def refresh_document() -> dict[str, Any]:
    """A config document for refresh tests: model `m` on providers pa (priority 0) and pb
    (priority 10) of node-1 (the `start_node` default), and node-2 with pc, which no test
    connects. Every listener on a free loopback port. A change applies to all at once (watched,
    `rollout.mode: watch`): the tests observe each live field on every request that follows;
    tests/edge/refresh/test_rollouts.py has the canary."""

    def fake(pid: str, **settings: Any) -> dict[str, Any]:
        adapter = {"type": "fake", "completion_tokens": 4}
        return provider(pid, adapter, served=f"served-{pid[1]}", capacity=2, **settings)

    document = build_document(
        nodes={"node-1": [fake("pa", priority=0), fake("pb", priority=10)], "node-2": [fake("pc")]},
        models={"m": ["pa", "pb"]},
        edge_id="edge-refresh",
        admin=True,
    )
    document["rollout"] = {"mode": "watch"}
    return document


@pytest.fixture(name="refresh_document", scope="session")
def refresh_document_fixture() -> Callable[[], dict[str, Any]]:
    """`refresh_document()`: a fresh copy of the refresh tests' config document."""
    return refresh_document


@pytest.fixture(scope="session")
def refresh_client_token() -> str:
    """An OpenAI API key `refresh_document()` configures."""
    return CLIENT_TOKEN


@pytest.fixture
async def start_edge() -> AsyncIterator[Callable[..., Awaitable[EdgeServer]]]:
    """`await start_edge(config_or_document, **EdgeServer_options)`: an in-process Edge serving
    its admin API on the config's admin listener; stopped when the test ends."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(config: EdgeConfig | dict[str, Any], **options: Any) -> EdgeServer:
            if not isinstance(config, EdgeConfig):
                config = load_data(config)
            options.setdefault("admin_listen", config.edge.admin.listen)
            options.setdefault("shutdown_grace_s", 1.0)
            options.setdefault("ack_timeout_s", 5.0)
            return await stack.enter_async_context(EdgeServer(config, **options))

        yield start


class IopProcesses:
    """Real `iop edge run` / `iop node run` children, stopped by the caller's exit stack.

    Configs of these Edges carry `tls.edge_section()`: the Nodes dial with `tls.node_args()`.
    """

    tls = TEST_TLS

    async def edge(
        self,
        stack: contextlib.AsyncExitStack,
        config: Path,
        *extra: str,
        env: Mapping[str, str] | None = None,
        log_file: Path | None = None,
    ) -> tuple[asyncio.subprocess.Process, dict[str, Any]]:
        """Start an Edge on `config` (`env`: variables on top of the tests'; `log_file`: where
        its log goes, else the tests' stderr); returns it and its start line (url, hub_port,
        admin_url)."""
        process, started = await spawn_edge(
            config, *extra, startup_timeout=30, env=env, log_file=log_file
        )
        stack.push_async_callback(terminate, process)
        return process, started

    async def node(
        self,
        stack: contextlib.AsyncExitStack,
        hub_port: int,
        node_id: str,
        token_file: Path,
        env: Mapping[str, str] | None = None,
    ) -> asyncio.subprocess.Process:
        """Start a Node that dials the Edge's hub on `hub_port` (over the tests' mutual TLS;
        `env`: variables on top of the tests')."""
        process = await spawn_node(hub_port, node_id, token_file, *TEST_TLS.node_args(), env=env)
        stack.push_async_callback(terminate, process)
        return process

    async def wait_available(self, url: str, providers: list[str], timeout: float = 20) -> None:
        """Until the Edge's /readyz lists exactly `providers` as available to dispatch."""
        await wait_available(url, providers, timeout)


@pytest.fixture(scope="session")
def iop_processes() -> IopProcesses:
    return IopProcesses()


# -- a real Redis for the shared limit store (openai.limit_store) ------------------------------


def ensure_redis_server() -> str:
    """The path of `redis-server`, installing Debian's package (as root) when it is missing."""
    found = shutil.which("redis-server")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.fail("the limit store tests need redis-server: apt-get install redis-server")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    wait = ["-o", "DPkg::Lock::Timeout=300"]  # another worktree's apt-get may hold the lock
    install = ["apt-get", *wait, "install", "-y", "--no-install-recommends", "redis-server"]
    result = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:  # the package lists may be missing or stale
        subprocess.run(["apt-get", *wait, "update"], env=env, capture_output=True, check=False)
        result = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    found = shutil.which("redis-server")
    if result.returncode != 0 or not found:
        pytest.fail(f"apt-get install redis-server failed:\n{result.stderr[-2000:]}")
    return found


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real Redis on loopback for the session (no persistence); tests isolate themselves by
    their own `key_prefix`."""
    with redis_server() as (url, _):
        yield url


@contextlib.contextmanager
def redis_server() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real Redis of the caller's own (no persistence): its URL and process."""
    binary = ensure_redis_server()
    port = free_port()
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def answers() -> bool:
            assert server.poll() is None, f"redis-server exited with {server.returncode}"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as probe:
                    probe.sendall(b"PING\r\n")
                    return probe.recv(16).startswith(b"+PONG")
            except OSError:
                return False

        wait_for(answers, timeout=20, interval=0.05, what=f"redis-server on port {port}")
        yield f"redis://127.0.0.1:{port}", server
    finally:
        server.send_signal(signal.SIGCONT)  # a test may have stopped it
        server.terminate()
        server.wait(timeout=10)
