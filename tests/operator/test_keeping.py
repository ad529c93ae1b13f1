"""The configs of the cluster revisions kept in the cluster (`keeping.ConfigKeeper`, on the fake
API): written when a revision is added and not otherwise, read back once and only when asked, a
failed write costs nothing but a retry on the next pass, and a change by someone else is written
over again."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.web
import pytest

from iop.edgeconfig import EdgeConfig, config_hash, load_data
from iop.operator.documents import Owner
from iop.operator.keeping import ConfigKeeper
from iop.operator.kubeapi import KubeApi

from .fakeapi import FakeApi, fake_api

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

OWNER = Owner("demo", "ns", "uid-1")
KEPT = "/api/v1/namespaces/ns/configmaps/demo-edge-revisions"


class RefusingApi(FakeApi):
    """The fake API, refusing the next `refusals` writes of the kept configs (403: a Role
    without the name, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.refusals = 0

    async def _handle(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        if request.method == "PATCH" and request.path == KEPT and self.refusals:
            self.refusals -= 1
            body = {"kind": "Status", "reason": "Forbidden", "message": "no", "code": 403}
            return aiohttp.web.json_response(body, status=403)
        return await super()._handle(request)


@pytest.fixture
async def api() -> AsyncIterator[tuple[RefusingApi, KubeApi]]:
    fake = RefusingApi()
    async with fake_api(fake) as client:
        yield fake, client


def configs(document: dict[str, Any], count: int) -> list[tuple[str, EdgeConfig]]:
    made = []
    for capacity in range(1, count + 1):
        changed = copy.deepcopy(document)
        changed["nodes"][0]["providers"][0]["capacity"] = capacity
        config = load_data(changed)
        made.append((config_hash(config), config))
    return made


def writes(fake: FakeApi) -> int:
    return fake.calls.count(("PATCH", KEPT))


async def test_a_revision_added_is_kept_and_nothing_else_is_written(
    api: tuple[RefusingApi, KubeApi], document: dict[str, Any]
) -> None:
    fake, client = api
    (h1, c1), (h2, c2) = configs(document, 2)
    keeper = ConfigKeeper(client)
    await keeper.keep(OWNER, [], [(1, h1)], {h1: c1})
    await keeper.keep(OWNER, [(1, h1)], [(2, h2), (1, h1)], {h2: c2})
    assert writes(fake) == 2
    await keeper.keep(OWNER, [(2, h2), (1, h1)], [(2, h2), (1, h1)], {h2: c2})  # an idle pass
    assert writes(fake) == 2
    assert set(fake.objects[KEPT]["binaryData"]) == {f"{h1}.json.gz", f"{h2}.json.gz"}

    # A new operator reads them back only when asked, and once.
    fake.calls.clear()
    again = ConfigKeeper(client)
    assert await again.config_of(OWNER, h1) == c1
    assert await again.config_of(OWNER, h2) == c2
    assert fake.calls.count(("GET", KEPT)) == 1
    # Another EdgeConfig's of the same name (a deleted namesake's) holds nothing for this one.
    assert await ConfigKeeper(client).config_of(Owner("demo", "ns", "uid-2"), h1) is None


async def test_a_failed_write_costs_a_retry_on_the_next_pass(
    api: tuple[RefusingApi, KubeApi], document: dict[str, Any]
) -> None:
    fake, client = api
    ((h1, c1),) = configs(document, 1)
    keeper = ConfigKeeper(client)
    fake.refusals = 1
    await keeper.keep(OWNER, [], [(1, h1)], {h1: c1})  # logged, not raised
    assert KEPT not in fake.objects
    await keeper.keep(OWNER, [(1, h1)], [(1, h1)], {h1: c1})  # the next pass: no new revision
    assert f"{h1}.json.gz" in fake.objects[KEPT]["binaryData"]
    assert await keeper.config_of(OWNER, h1) == c1


async def test_a_change_by_someone_else_is_written_over_on_the_next_pass(
    api: tuple[RefusingApi, KubeApi], document: dict[str, Any]
) -> None:
    fake, client = api
    ((h1, c1),) = configs(document, 1)
    keeper = ConfigKeeper(client)
    assert not keeper.changed_by_others(True, "")  # nothing held yet: nothing to put back
    await keeper.keep(OWNER, [], [(1, h1)], {h1: c1})
    version = fake.objects[KEPT]["metadata"]["resourceVersion"]
    assert not keeper.changed_by_others(False, version)  # its own write
    del fake.objects[KEPT]
    assert keeper.changed_by_others(True, "")
    await keeper.keep(OWNER, [(1, h1)], [(1, h1)], {h1: c1})
    assert f"{h1}.json.gz" in fake.objects[KEPT]["binaryData"]
    version = fake.objects[KEPT]["metadata"]["resourceVersion"]
    assert not keeper.changed_by_others(False, version)
