"""Tokens read from Secrets are checked before they are used: a value that cannot be a token (a
line break, empty, too long, not printable ASCII: a TLS key named by mistake) is reported by its
Secret and key, never by its content, and stops the pass before anything is written; a
reference to the webhook certificate's Secret is refused as an invalid spec."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from iop.edge import EdgeServer
from iop.edgeconfig import load_data
from iop.operator.adminapi import EdgeAdmin
from iop.operator.discovering import FixedReplicas
from iop.operator.documents import Owner
from iop.operator.kubeapi import KubeApi
from iop.operator.reconciling import Reconciler
from iop.operator.tokensecrets import SecretCache, read_tokens, reserved_refs, token_problem
from iop.operator.webhook import SelfSignedCertificate
from testkit import edge_document, provider

from .fakeapi import FakeApi, fake_api

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

PATH = "/apis/iop.dev/v1alpha1/namespaces/ns/edgeconfigs/demo"
SECRETS = "/api/v1/namespaces/ns/secrets"
#: What a TLS key looks like: several lines (the review named the webhook's key as the token).
#: A real key of several lines, made for the test (none is kept in the repository).
KEY = SelfSignedCertificate.create(["demo-operator-webhook.ns.svc"]).key_pem.decode()
WEBHOOK_SECRET = "demo-operator-webhook-tls"


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        pytest.param(b"s3cr3t-Token_0", None, id="token"),
        pytest.param(b"s3cr3t\n", None, id="trailing-newline-dropped"),
        pytest.param(b"", "is empty", id="empty"),
        pytest.param(b" \n\t", "is empty", id="white-space"),
        pytest.param(KEY.encode(), "holds a line break", id="pem-key"),
        pytest.param(b"one\rtwo", "holds a line break", id="carriage-return"),
        pytest.param(b"one two", "not printable ASCII", id="space"),
        pytest.param(b"one\x00two", "not printable ASCII", id="control"),
        pytest.param("jeton-\u00e9".encode(), "not printable ASCII", id="not-ascii"),
        pytest.param(b"\x30\x82\x01\x0a", "not printable ASCII", id="binary"),
        pytest.param(b"x" * 4097, "longer than 4096", id="too-long"),
    ],
)
def test_a_token_is_one_line_of_printable_ascii(raw: bytes, problem: str | None) -> None:
    found = token_problem(raw)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


def document() -> dict[str, Any]:
    return edge_document(
        {"local": [provider("pa", served="served-a", capacity=4)]},
        {"m": ["pa"]},
        placement="edge",
        admin=True,
    )


def spec_naming(secret: str, key: str = "token") -> dict[str, Any]:
    """The spec of `document` with its admin token read from Secret `secret`, key `key`."""
    spec = document()
    spec["edge"]["admin"]["token_secret"] = {"name": secret, "key": key}
    return spec


def secret(name: str, **data: str) -> dict[str, Any]:
    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "data": encoded}


def test_a_reference_to_the_webhook_certificate_is_refused_with_its_path() -> None:
    config = load_data(spec_naming(WEBHOOK_SECRET, "tls.key"))
    (problem,) = reserved_refs(config, {WEBHOOK_SECRET})
    assert problem.path == "edge.admin.tokenSecret.name"
    assert (
        WEBHOOK_SECRET in problem.message and "a certificate the operator made" in problem.message
    )
    assert reserved_refs(load_data(spec_naming("mine")), {WEBHOOK_SECRET}) == []


@pytest.fixture
async def api() -> AsyncIterator[tuple[FakeApi, KubeApi]]:
    fake = FakeApi()
    async with fake_api(fake) as started:
        yield fake, started


async def test_a_multi_line_token_is_named_by_secret_and_key_never_shown(
    api: tuple[FakeApi, KubeApi],
) -> None:
    fake, kube = api
    fake.objects[f"{SECRETS}/bad"] = secret("bad", token=KEY)
    config = load_data(spec_naming("bad"))
    tokens = await read_tokens(kube, Owner("demo", "ns", "uid-1"), config, SecretCache())
    assert tokens.admin_token is None and tokens.hashes == {}
    (said,) = tokens.invalid
    assert said.startswith("Secret bad key token (named by edge.admin.tokenSecret) holds a line")
    assert "PRIVATE" not in said and "MIGH" not in said


class Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str, str]] = []

    def post(self, owner: Owner, kind: str, reason: str, message: str) -> None:
        self.posted.append((kind, reason, message))


@pytest.fixture
async def operator(
    api: tuple[FakeApi, KubeApi], start_edge: Callable[..., Awaitable[EdgeServer]]
) -> AsyncIterator[tuple[FakeApi, Reconciler, Events]]:
    """A reconciler of `demo` in `ns` whose one replica is a real Edge (its admin API)."""
    fake, kube = api
    edge = await start_edge(document())
    events = Events()
    admin = EdgeAdmin()
    await admin.start()
    reconciler = Reconciler(
        "ns",
        "demo",
        api=kube,
        admin=admin,
        finder=FixedReplicas([str(edge.admin_url)]),
        events=events,  # type: ignore[arg-type]
        reserved_secrets=[WEBHOOK_SECRET],
    )
    try:
        yield fake, reconciler, events
    finally:
        await reconciler.stop()
        await admin.stop()


def edgeconfig(spec: dict[str, Any]) -> dict[str, Any]:
    metadata = {"name": "demo", "namespace": "ns", "uid": "uid-1", "generation": 1}
    return {"apiVersion": "iop.dev/v1alpha1", "kind": "EdgeConfig", "metadata": metadata,
            "spec": spec, "status": {}}  # fmt: skip


def conditions(fake: FakeApi) -> dict[str, dict[str, Any]]:
    status = fake.objects[PATH]["status"]
    return {c["type"]: c for c in status["conditions"]}


async def test_a_pass_with_a_multi_line_admin_token_is_degraded_and_applies_nothing(
    operator: tuple[FakeApi, Reconciler, Events],
) -> None:
    fake, reconciler, events = operator
    fake.objects[f"{SECRETS}/bad"] = secret("bad", token=KEY)
    fake.objects[PATH] = edgeconfig(spec_naming("bad"))

    result = await reconciler.reconcile(fake.objects[PATH], 0.0)

    found = conditions(fake)
    assert (found["Degraded"]["status"], found["Degraded"]["reason"]) == (
        "True",
        "TokenSecretInvalid",
    )
    assert "Secret bad key token" in found["Degraded"]["message"]
    assert found["Stalled"]["status"] == "True" and found["Ready"]["status"] == "False"
    assert not result.retry  # the Secret's watch wakes the next pass
    (warning,) = [e for e in events.posted if e[1] == "TokenSecretInvalid"]
    assert warning[0] == "Warning" and "Secret bad key token" in warning[2]
    # Never the content, anywhere the operator wrote.
    written = json.dumps(fake.objects[PATH]["status"]) + json.dumps(events.posted)
    assert "PRIVATE" not in written and "MIGH" not in written
    assert not any("configmaps" in path for path in fake.objects)  # nothing applied


async def test_a_pass_naming_the_webhook_certificate_is_an_invalid_spec(
    operator: tuple[FakeApi, Reconciler, Events],
) -> None:
    fake, reconciler, events = operator
    fake.objects[f"{SECRETS}/{WEBHOOK_SECRET}"] = secret(WEBHOOK_SECRET, **{"tls.key": KEY})
    fake.objects[PATH] = edgeconfig(spec_naming(WEBHOOK_SECRET, "tls.key"))

    await reconciler.reconcile(fake.objects[PATH], 0.0)

    assert conditions(fake)["Valid"]["status"] == "False"
    problems = fake.objects[PATH]["status"]["problems"]
    assert [p["path"] for p in problems] == ["edge.admin.tokenSecret.name"]
    assert ("GET", f"{SECRETS}/{WEBHOOK_SECRET}") not in fake.calls  # never read
    assert [e[1] for e in events.posted] == ["InvalidSpec"]
