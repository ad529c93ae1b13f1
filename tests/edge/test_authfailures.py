"""Failed authentications are counted per address and reason; an address that spent its budget
is throttled until it refills; the log says who and which key (by hash prefix), never the key,
and stays short whatever the guesser does."""

from __future__ import annotations

import logging

import pytest

from iop.edge.authfailures import AuthFailures, source_of, token_hint


@pytest.mark.parametrize(
    ("address", "key"),
    [
        pytest.param("10.0.0.7", "10.0.0.7", id="ipv4"),
        pytest.param("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64", id="ipv6-by-64"),
        pytest.param("2001:db8:1:2:bbbb::9", "2001:db8:1:2::/64", id="same-64"),
        pytest.param("::ffff:10.0.0.7", "10.0.0.7", id="ipv4-mapped"),
        pytest.param("unix-socket", "unix-socket", id="not-an-ip"),
    ],
)
def test_an_address_counts_as_its_host(address: str, key: str) -> None:
    assert source_of(address) == key


def test_an_address_that_spent_its_budget_is_throttled_and_others_are_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    failures = AuthFailures("the API", logging.getLogger("test.auth"), per_minute=5)
    secret = "sk-not-the-right-one"
    for _ in range(5):
        assert failures.retry_after("10.0.0.7") is None
        failures.failed("10.0.0.7", "invalid", f"token sha256 {token_hint(secret)}...")
    wait = failures.retry_after("10.0.0.7")
    assert wait is not None and 0 < wait <= 60 / 5
    assert failures.retry_after("10.0.0.8") is None
    assert failures.failures == {"invalid": 5}
    assert failures.throttled == 1
    text = "\n".join(record.getMessage() for record in caplog.records)
    assert secret not in text and token_hint(secret) in text and "10.0.0.7" in text
    # One line for the failures, one for the throttling, within the log interval.
    assert len(caplog.records) == 2, text


def test_the_table_of_addresses_is_bounded() -> None:
    failures = AuthFailures("the API", logging.getLogger("test.auth"), per_minute=1, max_sources=3)
    for index in range(10):
        failures.failed(f"10.0.0.{index}", "missing")
    assert failures.sources == 3
    assert failures.retry_after("10.0.0.9") is not None  # the newest are kept
    assert failures.retry_after("10.0.0.0") is None
