"""A config change on trial: which revision serves each request while the change is judged.

While a change is judged (`iop.edge.refresh.rollouts`), the dispatcher holds two snapshots: the
candidate (the change, what `Dispatcher.snapshot` is) and the stable one (the last good
revision). `Split` says which requests the candidate serves: every request of the `touched`
models that are not `shared` (a change of limits only, applied to all at once and watched),
and a `share` of the requests of the `shared` ones (a canary); everything else is served by the
stable revision's view of its model. A request's side is chosen once, when it arrives
(`Dispatcher.side_of`), and sticks to its conversation: the same conversation, or principal,
lands on the same side at every step below or above its bucket, on every Edge replica (the
bucket is a plain hash, keyed by nothing). docs/rollout.md, "The canary", has the model.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

from ..bodies import ParsedRequest

if TYPE_CHECKING:
    from .snapshots import PoolSnapshot

#: Which revision served a request: `STABLE` or `CANDIDATE`.
Side = Literal[0, 1]
#: The stable revision (also every request while no change is on trial).
STABLE: Final[Side] = 0
#: The candidate: the change on trial.
CANDIDATE: Final[Side] = 1
#: Each side's name in metrics and reports, by its number.
SIDE_NAMES: Final = ("stable", "candidate")

#: A share is counted in buckets: a request whose bucket is below `share * BUCKETS // 100` is the
#: candidate's.
BUCKETS: Final = 10_000


@dataclass(frozen=True, slots=True)
class Split:
    """Which requests a candidate serves; see the module docstring."""

    stable: PoolSnapshot
    #: The models the change altered; each request of one of them counts for the candidate or
    #: the stable revision in the judgement.
    touched: frozenset[str]
    #: Of those, the models whose requests are split by `share` (the others: all candidate).
    shared: frozenset[str]
    #: The candidate's share of the shared models' requests, in percent.
    share: int

    def with_share(self, share: int) -> Split:
        return Split(self.stable, self.touched, self.shared, share)

    def side_of(self, model_id: str, request: ParsedRequest, principal_ref: str) -> Side:
        if model_id not in self.touched:
            return STABLE
        if model_id not in self.shared or self.share >= 100:
            return CANDIDATE
        return CANDIDATE if sticky_bucket(request, principal_ref) < self.share * 100 else STABLE


def sticky_bucket(request: ParsedRequest, principal_ref: str) -> int:
    """The request's bucket, 0 to `BUCKETS - 1`: from the client's `user` field when it sends
    one, else from its conversation (a chat's first user message and what comes before it; a
    text prompt's first 256 bytes), with its principal."""
    user = request.document.get("user")
    if isinstance(user, str) and user:
        conversation = user.encode()
    else:
        conversation = _opening(request)
    digest = hashlib.blake2b(principal_ref.encode() + b"\0" + conversation, digest_size=8).digest()
    return int.from_bytes(digest) % BUCKETS


def _opening(request: ParsedRequest) -> bytes:
    if request.kind == "chat":
        parts: list[bytes] = []
        for message in request.document["messages"]:  # validated: objects with a role
            content = message.get("content")
            role = message["role"]
            parts.append(role.encode())
            parts.append(content.encode() if isinstance(content, str) else repr(content).encode())
            if role == "user":
                break
        return b"\0".join(parts)
    prompt = request.document.get("prompt", request.document.get("input", ""))
    return repr(prompt)[:256].encode()
