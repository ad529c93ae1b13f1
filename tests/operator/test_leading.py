"""One active operator among its replicas (the Lease), and the version it refuses to run on."""

from __future__ import annotations

import asyncio

import pytest

from iop.aiokits import stop_tasks
from iop.operator.errors import OperatorError
from iop.operator.leading import LeaderElection
from iop.operator.running import require_server_version

from .fakeapi import FakeApi, fake_api

LEASE = "/apis/coordination.k8s.io/v1/namespaces/ns/leases/op"


def election(api, identity: str) -> LeaderElection:
    return LeaderElection(api, "ns", "op", identity, lease_s=1.0, renew_deadline_s=0.6, retry_s=0.1)


async def test_one_replica_leads_and_the_other_takes_over_when_it_releases(until) -> None:
    fake = FakeApi()
    async with fake_api(fake) as api:
        first, second = election(api, "a"), election(api, "b")
        tasks = [asyncio.create_task(e.run(), name=e.identity) for e in (first, second)]
        try:
            await until(lambda: first.leading.is_set() or second.leading.is_set(), timeout=10)
            leader, standby = (first, second) if first.leading.is_set() else (second, first)
            # Five renewals later (each a PUT of the holder), the standby has still not taken it.
            renewals = len([c for c in fake.calls if c == ("PUT", LEASE)])
            await until(lambda: len([c for c in fake.calls if c == ("PUT", LEASE)]) >= renewals + 5)
            assert leader.leading.is_set() and not standby.leading.is_set()
            assert fake.objects[LEASE]["spec"]["holderIdentity"] == leader.identity

            await stop_tasks([tasks[[first, second].index(leader)]])
            await leader.release()
            assert fake.objects[LEASE]["spec"]["holderIdentity"] == ""
            await until(standby.leading.is_set, timeout=10)
            assert fake.objects[LEASE]["spec"]["holderIdentity"] == standby.identity
            assert fake.objects[LEASE]["spec"]["leaseTransitions"] == 1
        finally:
            await stop_tasks(tasks)


async def test_a_release_while_a_renewal_is_in_flight_gives_the_lease_up_for_good(until) -> None:
    """SIGTERM comes while the loop renews (its PUT in flight): the release waits for it, then
    empties the holder; the loop, still running, takes the Lease no more."""
    fake = FakeApi()
    async with fake_api(fake) as api:
        leader = election(api, "a")
        task = asyncio.create_task(leader.run())
        try:
            await until(leader.leading.is_set, timeout=10)
            fake.put_delay = 0.2
            puts = fake.calls.count(("PUT", LEASE))
            await until(lambda: fake.calls.count(("PUT", LEASE)) > puts, timeout=10)
            await leader.release()  # the renewal's PUT has not been applied yet
            assert fake.objects[LEASE]["spec"]["holderIdentity"] == ""
            fake.put_delay = 0.0
            writes = fake.calls.count(("PUT", LEASE))
            await asyncio.sleep(0.5)  # five of the loop's tries: none may write (an absence)
            assert fake.calls.count(("PUT", LEASE)) == writes
            assert fake.objects[LEASE]["spec"]["holderIdentity"] == ""
            assert not leader.leading.is_set()
        finally:
            await stop_tasks([task])


async def test_a_leader_that_stops_renewing_loses_the_lease_after_its_duration(until) -> None:
    fake = FakeApi()
    async with fake_api(fake) as api:
        first = election(api, "a")
        task = asyncio.create_task(first.run(), name="a")
        await until(first.leading.is_set, timeout=10)
        await stop_tasks([task])  # killed: no release
        second = election(api, "b")
        other = asyncio.create_task(second.run(), name="b")
        try:
            loop = asyncio.get_running_loop()
            started = loop.time()
            await until(second.leading.is_set, timeout=10)
            # Not before the standby has seen the record unrenewed for the whole lease.
            assert loop.time() - started >= 1.0
        finally:
            await stop_tasks([other])


@pytest.mark.parametrize(
    ("version", "refused"),
    [
        pytest.param(("1", "29"), True, id="1.29"),
        pytest.param(("1", "30+"), False, id="1.30+"),
        pytest.param(("1", "37"), False, id="1.37"),
    ],
)
async def test_the_operator_says_which_kubernetes_it_needs(
    version: tuple[str, str], refused: bool
) -> None:
    async with fake_api(FakeApi(version)) as api:
        if refused:
            with pytest.raises(OperatorError, match=r"runs Kubernetes v1\.29\.0; .* needs 1\.30"):
                await require_server_version(api)
        else:
            await require_server_version(api)
