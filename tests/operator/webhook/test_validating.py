"""The webhook's answers about tokens and ownership: a spec naming the webhook certificate's
Secret is refused with its path; a token Secret that holds no usable token is said (by Secret and
key, never its content); an EdgeConfig this operator does not serve is admitted with a warning
naming the one it serves, unless another release's operator writes its status; and the pin
(`iop.dev/pin-revision`): `stable` or a revision number, warned about while it is set; a spec
with more dialing nodes than `edge.nodeLink.maxConnections` admits is refused with both numbers."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import kopf
import pytest

from iop.operator.webhook import SelfSignedCertificate, register_webhook
from iop.operator.webhook.validating import UNOWNED_ID, WEBHOOK_ID
from testkit import edge_document, provider

from ..fakeapi import FakeApi, fake_api

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

#: A real key of several lines, made for the test (none is kept in the repository).
KEY = SelfSignedCertificate.create(["demo-operator-webhook.ns.svc"]).key_pem.decode()
WEBHOOK_SECRET = "demo-operator-webhook-tls"

Handler = Callable[..., Awaitable[None]]


class NoWorkers:
    """The webhook asks the workers for the config applied; none here."""

    def reconciler(self, namespace: str, name: str) -> None:
        return None


def spec(secret: str | None = None, key: str = "token") -> dict[str, Any]:
    document = edge_document(
        {"local": [provider("pa", served="served-a", capacity=4)]},
        {"m": ["pa"]},
        placement="edge",
        admin=True,
    )
    if secret is not None:
        document["edge"]["admin"]["token_secret"] = {"name": secret, "key": key}
    return document


def body(
    name: str, spec: dict[str, Any], status: dict[str, Any] | None = None, **metadata: Any
) -> kopf.Body:
    raw: dict[str, Any] = {
        "apiVersion": "iop.dev/v1alpha1",
        "kind": "EdgeConfig",
        "metadata": {"name": name, "namespace": "ns", **metadata},
        "spec": spec,
    }
    if status is not None:
        raw["status"] = status
    return kopf.Body(raw)  # type: ignore[arg-type]


@pytest.fixture
async def handlers() -> AsyncIterator[tuple[FakeApi, dict[str, Handler]]]:
    """The operator of EdgeConfig `demo`'s webhook handlers by id, on a fake API."""
    fake = FakeApi()
    async with fake_api(fake) as api:
        registry = kopf.OperatorRegistry()
        register_webhook(
            registry,
            NoWorkers(),  # type: ignore[arg-type]
            api,
            edgeconfig="demo",
            reserved_secrets=[WEBHOOK_SECRET],
        )
        found = {str(h.id): h.fn for h in registry._webhooks.get_all_handlers()}
        yield fake, found  # type: ignore[misc]


async def review(handler: Handler, obj: kopf.Body, operation: str = "CREATE") -> list[str]:
    warnings: list[str] = []
    metadata = obj["metadata"]
    await handler(
        body=obj,
        warnings=warnings,
        name=metadata["name"],
        namespace=metadata["namespace"],
        operation=operation,
    )
    return warnings


async def test_naming_the_webhook_certificate_is_refused_with_its_path(
    handlers: tuple[FakeApi, dict[str, Handler]],
) -> None:
    _, found = handlers
    with pytest.raises(kopf.AdmissionError) as refused:
        await review(found[WEBHOOK_ID], body("demo", spec(WEBHOOK_SECRET, "tls.key")))
    message = str(refused.value)
    assert "edge.admin.tokenSecret.name" in message
    assert f"Secret {WEBHOOK_SECRET} holds a certificate the operator made" in message


async def test_a_multi_line_token_is_said_by_secret_and_key_only(
    handlers: tuple[FakeApi, dict[str, Handler]],
) -> None:
    fake, found = handlers
    fake.objects["/api/v1/namespaces/ns/secrets/bad"] = {
        "metadata": {"name": "bad"},
        "data": {"token": base64.b64encode(KEY.encode()).decode()},
    }
    warnings = await review(found[WEBHOOK_ID], body("demo", spec("bad")))
    said = "waiting: Secret bad key token (named by edge.admin.tokenSecret) holds a line break"
    assert [w for w in warnings if w.startswith(said)]
    assert not any("PRIVATE" in w or "MIGH" in w for w in warnings)


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE"])
async def test_another_edgeconfig_is_admitted_with_a_warning_naming_the_one_served(
    handlers: tuple[FakeApi, dict[str, Handler]], operation: str
) -> None:
    _, found = handlers
    invalid = {**spec(), "models": "not a list"}  # not validated: not this operator's
    warnings = await review(found[UNOWNED_ID], body("other", invalid), operation)
    assert warnings and "reconciles only EdgeConfig 'demo'" in warnings[0]
    assert "'other' is neither validated nor applied by it" in warnings[0]
    assert all(len(w) <= 256 for w in warnings)
    # A webhook configuration that sends it to /validate gets the same answer.
    assert await review(found[WEBHOOK_ID], body("other", invalid), operation) == warnings


async def test_its_own_edgeconfig_and_another_releases_get_no_ownership_warning(
    handlers: tuple[FakeApi, dict[str, Handler]],
) -> None:
    _, found = handlers
    assert await review(found[UNOWNED_ID], body("demo", spec())) == []
    beta = [
        {"manager": "kubectl-client-side-apply", "operation": "Update"},
        {"manager": "iop-operator/beta", "operation": "Apply", "subresource": "status"},
    ]
    assert await review(found[UNOWNED_ID], body("beta", spec(), managedFields=beta), "UPDATE") == []


#: The history an EdgeConfig's status shows: revisions 2 and 3 (1 left it).
STATUS = {
    "history": [
        {
            "revision": number,
            "configHash": f"{number:x}" * 64,
            "generation": number,
            "appliedAt": "2026-12-02T09:12:41Z",
            "livePaths": ["nodes[local].providers[pa].capacity"],
            "restartPaths": [],
            "outcome": "Promoted",
        }
        for number in (3, 2)
    ]
}


@pytest.mark.parametrize(
    ("value", "warning"),
    [
        pytest.param(
            "stable",
            "pinned: iop.dev/pin-revision=stable holds the stable revision in effect; this spec "
            "is not applied until the annotation is removed",
            id="stable",
        ),
        pytest.param(
            "2",
            "pinned: iop.dev/pin-revision=2 holds revision 2 (config 222222222222) in effect "
            "while its config is kept; this spec is not applied until the annotation is removed",
            id="a-revision",
        ),
        pytest.param(
            "1",
            "pinned: iop.dev/pin-revision=1: revision 1 is not in the history (revisions 2 to "
            "3); the operator ignores the pin and applies this spec",
            id="not-in-the-history",
        ),
    ],
)
async def test_a_pin_is_admitted_with_a_warning_naming_what_it_holds(
    handlers: tuple[FakeApi, dict[str, Handler]], value: str, warning: str
) -> None:
    _, found = handlers
    pinned = body("demo", spec(), STATUS, annotations={"iop.dev/pin-revision": value})
    warnings = await review(found[WEBHOOK_ID], pinned, "UPDATE")
    assert warnings[-1] == warning
    assert all(len(w) <= 256 for w in warnings)
    unpinned = await review(found[WEBHOOK_ID], body("demo", spec(), STATUS), "UPDATE")
    assert not any(w.startswith("pinned") for w in unpinned)


@pytest.mark.parametrize("value", ["latest", "0", "-1", "03", "2.0", " 2", "1234567890", ""])
async def test_a_pin_that_is_neither_stable_nor_a_revision_number_is_refused_with_its_path(
    handlers: tuple[FakeApi, dict[str, Handler]], value: str
) -> None:
    _, found = handlers
    pinned = body("demo", spec(), STATUS, annotations={"iop.dev/pin-revision": value})
    with pytest.raises(kopf.AdmissionError) as refused:
        await review(found[WEBHOOK_ID], pinned, "UPDATE")
    assert str(refused.value) == (
        f"metadata.annotations[iop.dev/pin-revision]: {value!r} is not a pin; it takes "
        "'stable' (hold the stable revision) or a revision number (hold that revision; "
        "docs/rollout.md)"
    )


async def test_more_dialing_nodes_than_the_hub_admits_is_refused_naming_both_numbers(
    handlers: tuple[FakeApi, dict[str, Handler]],
) -> None:
    _, found = handlers
    document = edge_document(
        {"node-1": [provider("pa", served="served-a")], "node-2": [provider("pb")]},
        {"m": ["pa"]},
        admin=True,
        edge={"nodeLink": {"maxConnections": 1}},  # as the CRD spells it
    )
    with pytest.raises(kopf.AdmissionError) as refused:
        await review(found[WEBHOOK_ID], body("demo", document))
    message = str(refused.value)
    assert "edge.nodeLink.maxConnections: must be >= the 2 nodes that dial in" in message
    assert "got 1" in message
