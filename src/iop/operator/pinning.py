"""The pin: an EdgeConfig held on the stable revision or on revision N instead of its spec.

`iop.dev/pin-revision` is an emergency brake: while it is set, a pass brings into effect the
stable revision's config (`stable`) or revision N's (`"N"`, while its config is kept:
`keeping.py`) in place of the spec, and the spec is applied again once the annotation goes. A pin
that cannot be held (no such revision, its config not kept, or refused now by the upstream policy
or the reserved Secrets) is said and ignored. docs/rollout.md, "Seeing and steering it", says
when to pin.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from iop.edgeconfig import EdgeConfig, UpstreamPolicy

from . import conventions
from .announcing import Announcer
from .documents import KEPT_BUDGET, Owner
from .keeping import ConfigKeeper
from .recording import Recorder
from .tokensecrets import reserved_refs


@dataclass(slots=True, kw_only=True)
class Pinner:
    """Resolves the pin of one EdgeConfig, pass after pass (a pin set again is said again)."""

    recorder: Recorder
    keeper: ConfigKeeper
    announcer: Announcer
    policy: UpstreamPolicy | None
    #: Secrets no token may come from (a pin is refused one as a spec is).
    reserved: Collection[str]
    #: The pin as the last pass saw it: a pin set again is said again.
    seen: str | None = field(default=None, init=False)

    async def config(self, owner: Owner, body: Mapping[str, Any], spec: EdgeConfig) -> EdgeConfig:
        """The config to bring into effect: the spec's, or while the EdgeConfig is pinned
        (`iop.dev/pin-revision`, an emergency: the spec is applied again once the annotation
        goes) the stable revision's (`stable`) or revision N's (`"N"`, while its config is kept).
        A pin that cannot be held is said and ignored: the spec is applied."""
        pin = conventions.pin_of(body)
        if pin != self.seen:
            self.announcer.forget(("Pinned", "PinIgnored"))
            self.seen = pin
        if pin is None:
            return spec
        held, what = await self._target(owner, body, pin)
        if held is not None and (refused := self._refused_now(held)):
            held, what = None, f"{what} is not allowed now: {refused}"
        if held is None:
            self.announcer.say(
                owner,
                "Warning",
                "PinIgnored",
                f"{conventions.PIN_ANNOTATION}={pin!r} is ignored: {what}; the spec is applied",
            )
            return spec
        self.announcer.say(
            owner,
            "Warning",
            "Pinned",
            f"{conventions.PIN_ANNOTATION}={pin}: {what} is held in effect in place of the spec; "
            "remove the annotation to apply the spec",
        )
        return held

    def _refused_now(self, config: EdgeConfig) -> str:
        """What the upstream policy and the reserved Secrets refuse of a config that was allowed
        when it came into effect (a pin never brings back what a spec could not ask for now)."""
        problems = list(self.policy.config_problems(config)) if self.policy is not None else []
        problems += reserved_refs(config, self.reserved)
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        return "; ".join(str(p) for p in problems[:3]) + more

    async def _target(
        self, owner: Owner, body: Mapping[str, Any], pin: str
    ) -> tuple[EdgeConfig | None, str]:
        """(the config the pin holds, what it is), or (None, why the pin cannot be held)."""
        record = await self.recorder.load(owner)
        if pin == conventions.PIN_STABLE:
            stable = record.stable if record is not None else None
            if stable is None:
                return None, "the pin has no stable revision to hold yet (no config came through)"
            return stable.config, f"the stable config {stable.config_hash[:12]}"
        number = conventions.pinned_revision(pin)
        if number is None:
            return None, f"the pin takes {conventions.PIN_STABLE!r} or a revision number"
        history = self.announcer.history_of(owner, body.get("status") or {})
        entry = next((e for e in history if e.revision == number), None)
        if entry is None:
            listed = (
                f"revisions {history[-1].revision} to {history[0].revision}"
                if history
                else "none yet"
            )
            return None, f"revision {number} is not in the history ({listed})"
        digest = entry.config_hash
        config = None
        if record is not None and record.config_hash == digest:
            config = record.config
        elif record is not None and record.stable is not None:
            config = record.stable.config if record.stable.config_hash == digest else None
        if config is None:
            config = await self.keeper.config_of(owner, digest)
        if config is None:
            return None, (
                f"the config of revision {number} ({digest[:12]}) is not kept (the operator "
                f"keeps those of the revisions in the history, the newest first, up to "
                f"{KEPT_BUDGET // 1024} KiB compressed)"
            )
        return config, f"revision {number}'s config {digest[:12]}"
