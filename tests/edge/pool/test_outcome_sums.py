"""A watch's sum of the touched models' totals, read from the tally at once, is the sum a full
reading gives."""

from __future__ import annotations

import random

from iop.edge.pool import CANDIDATE, STABLE, OutcomeTally


def test_the_tallys_sum_of_some_models_is_the_readings() -> None:
    tally = OutcomeTally()
    chance = random.Random(7)
    models = [f"m-{i}" for i in range(20)]
    for _ in range(500):
        model = chance.choice(models)
        side = chance.choice((STABLE, CANDIDATE))
        tally.request(model, chance.choice((200, 200, 502, 404)), True, side, chance.randint(0, 2))
        tally.first_token(model, chance.uniform(0, 5), side)
        tally.duration(model, chance.uniform(0, 30), side)
    touched = [*models[:12], "never-asked"]
    reading = tally.reading()
    for side in (STABLE, CANDIDATE):
        assert tally.of(touched, side) == reading.of(touched, side)
        assert tally.of(touched, side).requests > 0
    assert tally.of([], STABLE) == reading.of([], STABLE)
