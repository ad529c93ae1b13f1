"""The status is written when it changes, judged against the body the pass had and what was
last written: a stale body (the watch event of our last write not yet arrived) must not hide a
change, and a status someone else overwrote is written again."""

from __future__ import annotations

from typing import Any

from iop.operator.documents import Owner
from iop.operator.status.model import EdgeConfigStatus, NodeEntry
from iop.operator.status.writing import StatusWriter

from ..fakeapi import FakeApi, fake_api

OWNER = Owner("demo", "ns", "uid-1")
PATH = "/apis/iop.dev/v1alpha1/namespaces/ns/edgeconfigs/demo"


def status(draining: int | None) -> EdgeConfigStatus:
    node = NodeEntry(node_id="node-2", state="Acked", reason="", draining_runs=draining)
    return EdgeConfigStatus(observed_generation=3, nodes=[node])


def stored(fake: FakeApi) -> dict[str, Any]:
    return fake.objects[PATH]["status"]  # type: ignore[no-any-return]


async def test_a_stale_body_does_not_hide_a_change_back() -> None:
    fake = FakeApi()
    fake.objects[PATH] = {"metadata": {"name": "demo", "resourceVersion": "1"}}
    idle, draining = status(None).document(), status(2).document()
    async with fake_api(fake) as api:
        writer = StatusWriter(api)
        await writer.write(OWNER, status(None), {})
        assert stored(fake) == idle
        await writer.write(OWNER, status(2), idle)
        assert stored(fake)["nodes"][0]["drainingRuns"] == 2
        # The drain is over; the pass still holds the body from before the count was written.
        await writer.write(OWNER, status(None), idle)
        assert stored(fake) == idle
        # Nothing changes: nothing is sent.
        await writer.write(OWNER, status(None), idle)
        assert writer.writes == 3
        assert stored(fake) == idle
        assert draining != idle


async def test_a_status_someone_else_overwrote_is_written_again() -> None:
    fake = FakeApi()
    fake.objects[PATH] = {"metadata": {"name": "demo", "resourceVersion": "1"}}
    async with fake_api(fake) as api:
        writer = StatusWriter(api)
        await writer.write(OWNER, status(None), {})
        overwritten = status(5).document()
        await writer.write(OWNER, status(None), overwritten)
        assert writer.writes == 2
        assert stored(fake) == status(None).document()
