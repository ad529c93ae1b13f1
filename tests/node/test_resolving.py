"""When a Node looks its Edge services up again (`ResolvePacing`, pure), and how it looks."""

from __future__ import annotations

import pytest

from iop.aiokits import resolve_service
from iop.node.resolving import ResolvePacing

INTERVAL = 30.0


def pacing() -> ResolvePacing:
    return ResolvePacing(INTERVAL, fast=1.0, fast_for=60.0)


@pytest.mark.parametrize(
    ("welcomed", "listed", "expected"),
    [
        pytest.param(0, 0, 1.0, id="nothing-listed"),
        pytest.param(0, 2, 1.0, id="none-welcomed"),
        pytest.param(2, 2, INTERVAL, id="all-welcomed"),
    ],
)
def test_without_a_loss_the_pace_is_fast_only_while_no_edge_welcomed_the_node(
    welcomed: int, listed: int, expected: float
) -> None:
    assert pacing().delay(0.0, welcomed=welcomed, listed=listed) == expected


def test_at_start_the_node_looks_fast_until_every_address_listed_welcomed_it() -> None:
    pace = pacing()
    pace.started(100.0)
    assert pace.delay(101.0, welcomed=1, listed=3) == 1.0
    assert pace.delay(159.0, welcomed=2, listed=3) == 1.0
    assert pace.delay(161.0, welcomed=2, listed=3) == INTERVAL  # bounded: one may never come


def test_after_a_loss_beside_another_replica_it_looks_fast_until_it_is_back_to_two() -> None:
    """The case a look-until-every-listed-address rule misses: the replaced replica is not
    listed yet (not ready), the Node is welcomed by every address listed (the other one)."""
    pace = pacing()
    pace.lost(100.0, welcomed_before=2)
    assert pace.delay(100.0, welcomed=1, listed=1) == 1.0
    assert pace.delay(110.0, welcomed=1, listed=2) == 1.0  # the new one is listed, not welcomed
    assert pace.delay(111.0, welcomed=2, listed=2) == INTERVAL  # back
    assert pace.delay(112.0, welcomed=1, listed=2) == INTERVAL  # no loss since: the slow pace


def test_the_fast_pace_after_a_loss_ends_after_its_bound() -> None:
    """A scale-down (two replicas to one) looks like a loss that never heals."""
    pace = pacing()
    pace.lost(100.0, welcomed_before=2)
    assert pace.delay(159.0, welcomed=1, listed=1) == 1.0
    assert pace.delay(161.0, welcomed=1, listed=1) == INTERVAL
    assert pace.delay(200.0, welcomed=1, listed=1) == INTERVAL
    pace.lost(300.0, welcomed_before=1)  # the next loss counts from what the Node had then
    assert pace.delay(300.0, welcomed=0, listed=0) == 1.0
    assert pace.delay(301.0, welcomed=1, listed=1) == INTERVAL


def test_losses_in_a_row_keep_the_most_edges_the_node_had() -> None:
    pace = pacing()
    pace.lost(100.0, welcomed_before=3)
    pace.lost(101.0, welcomed_before=2)
    assert pace.delay(102.0, welcomed=2, listed=2) == 1.0
    assert pace.delay(103.0, welcomed=3, listed=3) == INTERVAL


def test_the_shortest_time_between_two_lookups_is_the_fast_pace_or_the_interval() -> None:
    assert pacing().spacing == 1.0
    assert ResolvePacing(0.2).spacing == 0.2
    assert ResolvePacing(0.2).delay(0.0, welcomed=0, listed=1) == 0.2


async def test_resolve_service_lists_each_address_of_a_name_once_with_the_port() -> None:
    addresses = await resolve_service("localhost", 7443)
    assert "127.0.0.1:7443" in addresses
    assert len(addresses) == len(set(addresses))
