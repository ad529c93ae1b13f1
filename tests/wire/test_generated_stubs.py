"""The committed protobuf stubs are what scripts/gen-proto makes from runtime.proto today."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GENERATED = ("runtime_pb2.py", "runtime_pb2.pyi", "runtime_pb2_grpc.py", "runtime_pb2_grpc.pyi")


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    subprocess.run([str(REPO / "scripts" / "gen-proto"), str(tmp_path)], check=True, cwd=REPO)
    stale = [
        name
        for name in GENERATED
        if (tmp_path / "iop" / "wire" / name).read_bytes()
        != (REPO / "src" / "iop" / "wire" / name).read_bytes()
    ]
    assert not stale, f"stale generated files {stale}: run scripts/gen-proto and commit"
