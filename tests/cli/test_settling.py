"""`settle()`: what start-up left alive is frozen out of the cyclic collector's scans."""

from __future__ import annotations

import gc

from iop.cli.settling import settle


def test_settle_freezes_what_is_alive() -> None:
    held = [object() for _ in range(10)]
    try:
        settle()
        assert gc.get_freeze_count() >= len(held)
    finally:
        gc.unfreeze()
