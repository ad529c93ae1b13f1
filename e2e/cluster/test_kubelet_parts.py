"""The process kubelet's pure parts (e2e/cluster/kubelet), without a cluster.

What the e2e tests cannot pin down cheaply: $(VAR) expansion, resource quantities, the atomic
writer's swap of `..data`, Services' link variables. Images and security contexts:
test_kubelet_images.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from e2e.cluster.kubelet.downward import quantity, resource_value
from e2e.cluster.kubelet.envs import expand, service_links
from e2e.cluster.kubelet.volumes import write_atomically


@pytest.mark.parametrize(
    ("text", "expanded"),
    [
        pytest.param("$(A)-$(B)", "1-$(B)", id="unknown-stays"),
        pytest.param("$$(A)", "$(A)", id="escaped"),
        pytest.param("$A", "$A", id="shell-style-untouched"),
    ],
)
def test_variable_references_expand_as_in_kubernetes(text: str, expanded: str) -> None:
    assert expand(text, {"A": "1"}) == expanded


def test_resource_fields_use_the_divisor_and_round_up() -> None:
    container = {"resources": {"limits": {"memory": "300Mi", "cpu": "250m"}}}
    assert resource_value(container, {"resource": "limits.memory", "divisor": "1Mi"}, {}) == "300"
    assert resource_value(container, {"resource": "limits.cpu"}, {}) == "1"
    assert resource_value({}, {"resource": "limits.cpu"}, {"cpu": "2"}) == "2"
    assert quantity("1.5Gi") == 1.5 * 2**30


def test_the_atomic_writer_swaps_data_and_drops_stale_keys(tmp_path: Path) -> None:
    folder = tmp_path / "volume"
    assert write_atomically(folder, {"a": (b"1", 0o644), "b": (b"2", 0o600)})
    first = os.readlink(folder / "..data")
    assert not write_atomically(folder, {"a": (b"1", 0o644), "b": (b"2", 0o600)})

    assert write_atomically(folder, {"a": (b"3", 0o644)})

    assert os.readlink(folder / "..data") != first
    assert (folder / "a").read_text() == "3"
    assert os.readlink(folder / "a") == "..data/a"
    assert not (folder / "b").exists()
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("..2")) == [
        os.readlink(folder / "..data")
    ]


def test_services_give_docker_link_variables() -> None:
    services = [
        {
            "metadata": {"name": "iop-edge"},
            "spec": {
                "clusterIP": "10.252.0.7",
                "ports": [
                    {"name": "grpc", "port": 7443, "protocol": "TCP"},
                    {"name": "open-ai", "port": 8080, "protocol": "TCP"},
                ],
            },
        },
        {"metadata": {"name": "headless"}, "spec": {"clusterIP": "None", "ports": [{"port": 1}]}},
    ]
    env = service_links(services)
    assert env["IOP_EDGE_SERVICE_HOST"] == "10.252.0.7"
    assert env["IOP_EDGE_SERVICE_PORT"] == "7443"
    assert env["IOP_EDGE_SERVICE_PORT_OPEN_AI"] == "8080"
    assert env["IOP_EDGE_PORT"] == "tcp://10.252.0.7:7443"
    assert env["IOP_EDGE_PORT_8080_TCP_ADDR"] == "10.252.0.7"
    assert not [name for name in env if name.startswith("HEADLESS")]
