"""The upstream policy's rules: names, CIDRs, `public`, the built-in denials, the most specific
CIDR deciding, key bindings, and what a config that breaks it is told."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest

from iop.edgeconfig import ConfigError, UpstreamPolicy, load_data, parse_policy
from testkit import edge_document, provider

POLICY = parse_policy(
    """
allow: [vllm-a.ml.svc:8000, "*.models.example", 10.0.0.0/8, public]
deny: [10.96.0.0/12]
keys:
  - {env: VLLM_A_KEY, hosts: ["vllm-a.ml.svc:8000"], providers: [vllm-a]}
  - {env: OPENAI_KEY, hosts: [api.openai.com]}
"""
)


def verdict(policy: UpstreamPolicy, host: str, port: int, address: str) -> str | None:
    return policy.address_problem(host, port, ipaddress.ip_address(address))


@pytest.mark.parametrize(
    ("host", "port", "address", "allowed"),
    [
        pytest.param("vllm-a.ml.svc", 8000, "192.168.3.4", True, id="listed-name"),
        pytest.param("vllm-a.ml.svc", 8001, "192.168.3.4", False, id="listed-name-other-port"),
        pytest.param("x.models.example", 443, "192.168.3.4", True, id="wildcard"),
        pytest.param("models.example", 443, "192.168.3.4", False, id="wildcard-not-the-apex"),
        pytest.param("any", 80, "10.1.2.3", True, id="cidr"),
        pytest.param("any", 80, "10.96.0.1", False, id="deny-more-specific-than-allow"),
        pytest.param("vllm-a.ml.svc", 8000, "10.96.0.1", False, id="deny-beats-a-name"),
        pytest.param("any", 80, "8.8.8.8", True, id="public"),
        pytest.param("any", 80, "172.16.0.1", False, id="private-is-not-public"),
        pytest.param("any", 80, "100.64.0.1", False, id="cgnat-is-not-public"),
        pytest.param("vllm-a.ml.svc", 8000, "169.254.169.254", False, id="metadata-by-name"),
        pytest.param("vllm-a.ml.svc", 8000, "127.0.0.1", False, id="loopback-by-name"),
        pytest.param("any", 80, "::ffff:169.254.169.254", False, id="mapped-metadata"),
        pytest.param("any", 80, "::1", False, id="v6-loopback"),
        pytest.param("any", 80, "fe80::1", False, id="v6-link-local"),
        pytest.param("any", 80, "0.0.0.0", False, id="unspecified"),
    ],
)
def test_addresses(host: str, port: int, address: str, allowed: bool) -> None:
    assert (verdict(POLICY, host, port, address) is None) is allowed


def test_only_a_cidr_as_specific_as_a_built_in_denial_lets_its_addresses_in() -> None:
    wide = parse_policy("allow: [0.0.0.0/0, localhost]")
    assert verdict(wide, "localhost", 80, "127.0.0.1") is not None
    assert verdict(wide, "x", 80, "169.254.169.254") is not None
    sidecar = parse_policy("allow: [127.0.0.1/32]")
    assert verdict(sidecar, "localhost", 8000, "127.0.0.1") is None
    assert verdict(sidecar, "localhost", 8000, "127.0.0.2") is not None


def test_a_host_is_judged_before_it_is_resolved_only_as_far_as_it_can_be() -> None:
    names_only = parse_policy("allow: [vllm-a.ml.svc:8000]")
    assert names_only.host_problem("vllm-a.ml.svc", 8000) is None
    assert names_only.host_problem("evil.other.svc", 8000) is not None
    assert names_only.host_problem("169.254.169.254", 80) is not None
    # With a CIDR or `public` listed, a name may still be allowed by its addresses.
    assert POLICY.host_problem("evil.example.org", 443) is None
    assert POLICY.host_problem("10.96.0.1", 443) is not None


@pytest.mark.parametrize(
    ("env", "provider_id", "host", "port", "problem"),
    [
        pytest.param("VLLM_A_KEY", "vllm-a", "vllm-a.ml.svc", 8000, None, id="bound"),
        pytest.param("VLLM_A_KEY", "evil", "vllm-a.ml.svc", 8000, "may go only", id="provider"),
        pytest.param("VLLM_A_KEY", "vllm-a", "evil.ns.svc", 8000, "may go only", id="host"),
        pytest.param("VLLM_A_KEY", "vllm-a", "vllm-a.ml.svc", 9000, "may go only", id="port"),
        pytest.param("OPENAI_KEY", "any-provider", "api.openai.com", 443, None, id="any-provider"),
        pytest.param("HOME", "vllm-a", "vllm-a.ml.svc", 8000, "bound to no", id="unbound"),
    ],
)
def test_keys(env: str, provider_id: str, host: str, port: int, problem: str | None) -> None:
    found = POLICY.key_problem(env, provider_id, host, port)
    assert (found is None) if problem is None else (found is not None and problem in found)


def test_a_config_that_breaks_the_policy_is_told_every_problem_with_its_path() -> None:
    def openai(pid: str, url: str, env: str | None = None) -> dict[str, Any]:
        adapter = {"type": "openai", "base_url": url} | ({"api_key_env": env} if env else {})
        return provider(pid, adapter)

    config = load_data(
        edge_document(
            {
                "node-1": [
                    openai("vllm-a", "http://vllm-a.ml.svc:8000/v1", "VLLM_A_KEY"),
                    openai("stolen", "http://thief.other.svc:8000/v1", "VLLM_A_KEY"),
                    openai("metadata", "http://169.254.169.254/latest"),
                ]
            }
        )
    )
    with pytest.raises(ConfigError) as caught:
        parse_policy(
            "allow: [vllm-a.ml.svc:8000]\nkeys: [{env: VLLM_A_KEY, hosts: [vllm-a.ml.svc:8000]}]"
        ).require_allowed(config)
    assert [(p.path, p.message.split(" ", 3)[:3]) for p in caught.value.problems] == [
        ("nodes[0].providers[1].adapter.baseUrl", ["thief.other.svc:8000", "is", "not"]),
        ("nodes[0].providers[1].adapter.apiKeyEnv", ["the", "key", "in"]),
        ("nodes[0].providers[2].adapter.baseUrl", ["169.254.169.254", "is", "in"]),
    ]


def test_a_name_only_its_addresses_can_allow_is_noted_for_the_webhook() -> None:
    def openai(pid: str, url: str) -> dict[str, Any]:
        return provider(pid, {"type": "openai", "base_url": url})

    config = load_data(
        edge_document(
            {
                "node-1": [
                    openai("listed", "http://vllm-a.ml.svc:8000/v1"),
                    openai("unlisted", "https://api.example.org/v1"),
                    openai("address", "http://10.1.2.3:8000/v1"),
                ]
            }
        )
    )
    (note,) = POLICY.unlisted_names(config)
    assert note.path == "nodes[0].providers[1].adapter.baseUrl"
    assert note.message.startswith("api.example.org is listed by no name of the upstream policy")
    # A policy of names alone refuses such a host outright instead (config_problems).
    assert parse_policy("allow: [vllm-a.ml.svc:8000]").unlisted_names(config) == []


@pytest.mark.parametrize(
    ("text", "where"),
    [
        pytest.param("allow: [not a host]", "allow[0]", id="host"),
        pytest.param("deny: [vllm.svc]", "deny[0]", id="cidr"),
        pytest.param("keys: [{env: K, hosts: []}]", "keys[0].hosts", id="no-hosts"),
        pytest.param("keys: [{env: K, hosts: [public]}]", "keys[0].hosts[0]", id="public-key"),
        pytest.param("allow: [a.svc:99999]", "allow[0]", id="port"),
        pytest.param("alow: []", "alow", id="unknown-key"),
        pytest.param("allow: [", "", id="yaml"),
    ],
)
def test_a_bad_policy_names_what_is_wrong_and_where(text: str, where: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_policy(text, "policy.yaml")
    assert caught.value.problems[0].path == f"policy.yaml: {where}".rstrip(": ")
