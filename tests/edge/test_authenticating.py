"""Principal auth: tokens known by SHA-256 only, mapped to principal_ref and token_ref."""

from __future__ import annotations

import pytest

from iop.edge.authenticating import ANONYMOUS, Authenticator, Principal
from iop.edge.errors import Unauthorized
from testkit import CLIENT_TOKEN

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


@pytest.fixture
def section(config_of, provider):
    return config_of([provider("a")]).openai


def test_a_known_token_maps_to_its_principal_and_token_ref(section, tokens) -> None:
    auth = Authenticator(section)
    assert auth.authenticate(f"Bearer {tokens['search-chat']}".encode()) == Principal(
        "team-search", "search-chat"
    )
    # Several tokens share a principal; token_ref tells them apart. The scheme is case-blind.
    assert auth.authenticate(f"bearer {tokens['search-batch']}".encode()) == Principal(
        "team-search", "search-batch"
    )


@pytest.mark.parametrize(
    "header",
    [
        pytest.param(b"Bearer sk-wrong", id="unknown-token"),
        pytest.param(b"Bearer ", id="empty-token"),
        pytest.param(b"Basic dXNlcjpwYXNz", id="not-bearer"),
        pytest.param(CLIENT_TOKEN.encode(), id="no-scheme"),
    ],
)
def test_bad_tokens_are_refused(section, header: bytes) -> None:
    with pytest.raises(Unauthorized) as caught:
        Authenticator(section).authenticate(header)
    assert not caught.value.missing
    assert b"sk-" not in caught.value.message.encode()  # the token is never echoed


def test_a_missing_token_is_refused_unless_unauthenticated_requests_are_allowed(
    config_of, provider
) -> None:
    closed = config_of([provider("a")]).openai
    with pytest.raises(Unauthorized) as caught:
        Authenticator(closed).authenticate(None)
    assert caught.value.missing
    opened = config_of([provider("a")], openai={"allow_unauthenticated": True}).openai
    assert Authenticator(opened).authenticate(None) is ANONYMOUS
    with pytest.raises(Unauthorized):  # an unknown token is refused either way
        Authenticator(opened).authenticate(b"Bearer sk-wrong")
