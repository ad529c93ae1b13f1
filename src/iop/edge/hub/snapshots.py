"""The hub's snapshot of the config in use, and which connected Node a new one is pushed to.

`HubSnapshot` is everything the hub reads from the config, swapped as one reference; the next
one is built (`NodeHub.prepare`, in a worker thread) reusing the payloads of the nodes whose spec
did not change. A swap then pushes a connected Node its payload (`refresh_request`) only when
`needs_push` says so: not to a Node about to restart, nor to one that holds that payload already.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from iop.edgeconfig import EdgeConfig, NodePayload
from iop.wire import payload_to_proto
from iop.wire import runtime_pb2 as pb

from .nodesessions import NodeSession


@dataclass(frozen=True, slots=True)
class HubSnapshot:
    """Everything the hub reads from the config, swapped as one reference."""

    config: EdgeConfig
    generation: int
    payloads: Mapping[str, NodePayload]
    #: node id -> `payloads[node].digest`, computed once per payload (hashing is not free).
    digests: Mapping[str, str]
    provider_nodes: Mapping[str, str]
    token_hashes: Mapping[str, str]

    @classmethod
    def of(
        cls, config: EdgeConfig, generation: int, previous: HubSnapshot | None = None
    ) -> HubSnapshot:
        """The snapshot of `config`; a node whose spec is the same as in `previous` keeps its
        payload and digest (a live change to one node of thousands builds one payload)."""
        specs = {n.id: n for n in previous.config.nodes} if previous is not None else {}
        payloads: dict[str, NodePayload] = {}
        digests: dict[str, str] = {}
        for node in config.nodes:
            node_id = node.id
            if previous is not None and specs.get(node_id) == node:
                payloads[node_id] = previous.payloads[node_id]
                digests[node_id] = previous.digests[node_id]
                continue
            payload = NodePayload.of(node)
            before = previous.payloads.get(node_id) if previous is not None else None
            if previous is not None and before is not None and before == payload:
                payloads[node_id], digests[node_id] = before, previous.digests[node_id]
            else:
                payloads[node_id], digests[node_id] = payload, payload.digest
        return cls(
            config=config,
            generation=generation,
            payloads=MappingProxyType(payloads),
            digests=MappingProxyType(digests),
            provider_nodes=MappingProxyType(
                {p.id: node.id for node in config.nodes for p in node.providers}
            ),
            token_hashes=MappingProxyType(
                {n.id: n.token_hash_sha256 for n in config.nodes if n.token_hash_sha256}
            ),
        )


def refresh_request(session: NodeSession) -> pb.NodeConfigRefreshRequest:
    """The refresh carrying the payload last given to `session`."""
    config = payload_to_proto(session.payload, session.payload_generation, session.payload_digest)
    return pb.NodeConfigRefreshRequest(config=config)


def needs_push(session: NodeSession, digest: str, hold: Mapping[str, Collection[str]]) -> bool:
    """A swap to the payload of `digest` pushes it to `session` (see `NodeHub.swap_config`)."""
    return not _held(session, digest, hold) and not _holds(session, digest)


def _held(session: NodeSession, digest: str, hold: Mapping[str, Collection[str]]) -> bool:
    """`session`'s process is one the restart in `hold` replaces (see `NodeHub.swap_config`)."""
    replaced = hold.get(session.node_id)
    if replaced is None or session.in_use_hash == digest:
        return False
    return not replaced or session.instance_id in replaced


def _holds(session: NodeSession, digest: str) -> bool:
    """The node was sent the payload of `digest` last and (once welcomed) acknowledged it."""
    if session.payload_digest != digest:
        return False
    return not session.ready or session.applied_hash == digest
