"""`free_port`: ports that two pickers of one parallel run never share."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from iop.processes import free_port, share_ports

PICK = "from iop.processes import free_port; print(*[free_port() for _ in range(300)])"


def _picks(share: str) -> set[int]:
    env = {**os.environ, "IOP_PORT_SHARE": share}
    result = subprocess.run([sys.executable, "-c", PICK], env=env, capture_output=True, check=True)
    return {int(port) for port in result.stdout.split()}


def test_one_process_never_hands_out_a_port_twice() -> None:
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)


def test_processes_given_different_shares_pick_disjoint_ports() -> None:
    first, second = _picks("0/2"), _picks("1/2")
    assert len(first) == len(second) == 300
    assert not first & second
    assert max(first) < min(second)  # the shares are two halves, the first below the second


def test_a_share_is_inherited_by_the_children(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_PORT_SHARE", "0/1")  # and put back what it was afterwards
    share_ports(3, 8)
    assert os.environ["IOP_PORT_SHARE"] == "3/8"
    inherited = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ['IOP_PORT_SHARE'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert inherited.stdout.strip() == "3/8"
