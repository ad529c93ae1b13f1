"""The validating admission webhook: refuse an invalid EdgeConfig with every problem, and admit
a valid one with warnings that state the plan (`plans.py`).

It runs in the operator (`kopf.on.validate`), so it validates with exactly the reconcile's model
and classifies against exactly its base, the config last applied. It has no side effects
(`sideEffects: None`), so `kubectl apply --dry-run=server` calls it too and shows the plan
without changing anything. An operator that serves one EdgeConfig (`--edgeconfig`) also
answers for the others of its namespace (`UNOWNED_ID`), only to admit them with a warning that
it does not apply them. How the API server reaches it and what happens when it cannot
(certificates, `failurePolicy: Ignore`): docs/operator.md, "The webhook".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping
from typing import Any

import kopf

from iop.edgeconfig import (
    ConfigError,
    EdgeConfig,
    UpstreamPolicy,
    classify,
    config_hash,
    load_data,
    token_refs,
    token_sha256,
    with_token_hashes,
)

from .. import conventions
from ..documents import Owner, decode_state
from ..errors import KubeApiError, KubeNotFound
from ..kubeapi import FIELD_MANAGER, KubeApi, resource_path
from ..metrics import OperatorMetrics
from ..status import read_history
from ..tokensecrets import SecretCache, read_tokens, reserved_refs
from ..workers import Workers
from .plans import admission_message, plan_warnings, unowned_warnings

logger = logging.getLogger(__name__)

#: The handler id, which is also the URL path the webhook configuration points at (/validate).
WEBHOOK_ID = "validate"
#: The handler (and URL path) for the EdgeConfigs of the namespace this operator does not serve.
UNOWNED_ID = "unowned"
#: The hash a token the operator is still to generate counts as: a new token, unlike any other.
_TO_BE_GENERATED = token_sha256("a token the operator will generate")


def register_webhook(
    registry: kopf.OperatorRegistry,
    workers: Workers,
    api: KubeApi,
    metrics: OperatorMetrics | None = None,
    policy: UpstreamPolicy | None = None,
    *,
    edgeconfig: str | None = None,
    reserved_secrets: Collection[str] = (),
) -> None:
    """Add the validating webhook handlers to `registry`: `policy` refuses the providers it
    does not allow (`iop.edgeconfig.upstreampolicy`); `edgeconfig` names the one EdgeConfig
    this operator serves (None: all of its namespace); `reserved_secrets` no token may name."""

    def count(outcome: str) -> None:
        if metrics is not None:
            metrics.admissions.labels(outcome).inc()

    def unowned(body: kopf.Body, name: str | None, namespace: str | None) -> list[str]:
        """Warnings for an EdgeConfig this operator does not serve: none when it serves it, or
        another operator already reports on it (its status has another writer)."""
        if edgeconfig is None or name == edgeconfig or _served_by_another(body, edgeconfig):
            return []
        return unowned_warnings(name or "", edgeconfig, namespace or "")

    @kopf.on.validate(
        conventions.GROUP,
        conventions.VERSION,
        conventions.PLURAL,
        id=UNOWNED_ID,
        operations=["CREATE", "UPDATE"],
        side_effects=False,
        ignore_failures=True,
        registry=registry,
    )
    async def warn_unowned(
        body: kopf.Body, warnings: list[str], name: str | None, namespace: str | None, **_: Any
    ) -> None:
        """Never refuses: the API server asks it for every other EdgeConfig of the namespace."""
        said = unowned(body, name, namespace)
        warnings.extend(said)
        if said:
            count("unowned")

    @kopf.on.validate(
        conventions.GROUP,
        conventions.VERSION,
        conventions.PLURAL,
        id=WEBHOOK_ID,
        operations=["CREATE", "UPDATE"],
        side_effects=False,
        ignore_failures=True,
        registry=registry,
    )
    async def validate(
        body: kopf.Body, warnings: list[str], name: str, namespace: str | None, **kwargs: Any
    ) -> None:
        operation = kwargs.get("operation")
        if said := unowned(body, name, namespace):  # a configuration that sent it here anyway
            warnings.extend(said)
            count("unowned")
            return
        pin = conventions.pin_of(body)
        if pin is not None and not conventions.is_pin(pin):
            if metrics is not None:
                metrics.admissions.labels("refused").inc()
            raise kopf.AdmissionError(
                f"metadata.annotations[{conventions.PIN_ANNOTATION}]: {pin!r} is not a pin; "
                f"it takes {conventions.PIN_STABLE!r} (hold the stable revision) or a revision "
                "number (hold that revision; docs/rollout.md)",
                code=422,
            )
        spec = dict(body.get("spec") or {})
        try:
            desired = await asyncio.to_thread(load_data, spec)
            if policy is not None:
                policy.require_allowed(desired)
        except ConfigError as error:
            if metrics is not None:
                metrics.admissions.labels("refused").inc()
            raise kopf.AdmissionError(admission_message(error), code=422) from None
        if reserved := reserved_refs(desired, reserved_secrets):
            if metrics is not None:
                metrics.admissions.labels("refused").inc()
            raise kopf.AdmissionError(admission_message(ConfigError(reserved)), code=422)
        desired, waiting, invalid = await _with_tokens(api, namespace or "", name or "", desired)
        # A new object has nothing applied (a record left by a deleted namesake is not its base).
        base = None
        if operation != "CREATE":
            base = await _applied_base(workers, api, namespace or "", name or "")
        change = classify(base, desired) if base is not None else None
        warnings.extend(
            plan_warnings(change, desired, config_hash(desired), waiting, base, invalid=invalid)
        )
        if policy is not None:
            warnings.extend(f"policy: {note}" for note in policy.unlisted_names(desired))
        if pin is not None:
            warnings.append(pin_warning(pin, body))
        if metrics is not None:
            metrics.admissions.labels("allowed").inc()


def pin_warning(pin: str, body: Mapping[str, Any]) -> str:
    """The warning while the EdgeConfig is pinned: the revision it holds, from the history its
    status shows (the operator says with a `PinIgnored` Event when it cannot hold it)."""
    held = f"pinned: {conventions.PIN_ANNOTATION}={pin}"
    number = conventions.pinned_revision(pin)
    if number is None:
        return (
            f"{held} holds the stable revision in effect; this spec is not applied until the "
            "annotation is removed"
        )
    history = read_history(body.get("status") or {})
    entry = next((e for e in history if e.revision == number), None)
    if entry is None:
        listed = (
            f"revisions {history[-1].revision} to {history[0].revision}" if history else "none yet"
        )
        return (
            f"{held}: revision {number} is not in the history ({listed}); the operator ignores "
            "the pin and applies this spec"
        )
    return (
        f"{held} holds revision {number} (config {entry.config_hash[:12]}) in effect while its "
        "config is kept; this spec is not applied until the annotation is removed"
    )


async def _with_tokens(
    api: KubeApi, namespace: str, name: str, spec: EdgeConfig
) -> tuple[EdgeConfig, list[str], list[str]]:
    """The spec with the hashes of the tokens its Secrets hold, as the reconcile will see it
    (read only: a token still to be generated counts as a new one), what is missing, and what
    holds no usable token."""
    owner = Owner(name, namespace, "")
    try:
        tokens = await read_tokens(api, owner, spec, SecretCache(), generate=False)
    except KubeApiError as error:  # the plan is a courtesy: say the tokens are unknown
        logger.warning("no token hashes for the plan of %s/%s: %s", namespace, name, error)
        return spec, [], []
    hashes = {ref.key: _TO_BE_GENERATED for ref in token_refs(spec)}
    hashes.update(tokens.hashes)
    resolved = await asyncio.to_thread(with_token_hashes, spec, hashes)
    return resolved, list(tokens.missing), list(tokens.invalid)


def _served_by_another(body: Mapping[str, Any], edgeconfig: str) -> bool:
    """Whether another release's operator writes the status of `body` (its managedFields)."""
    mine = f"{FIELD_MANAGER}/{edgeconfig}"
    return any(
        entry.get("subresource") == "status"
        and str(entry.get("manager", "")).startswith(FIELD_MANAGER)
        and entry.get("manager") != mine
        for entry in body.get("metadata", {}).get("managedFields") or ()
    )


async def _applied_base(
    workers: Workers, api: KubeApi, namespace: str, name: str
) -> EdgeConfig | None:
    """The config last applied for this EdgeConfig: the worker's copy, else the record."""
    reconciler = workers.reconciler(namespace, name)
    if reconciler is not None and reconciler.applied is not None:
        return reconciler.applied.config
    if not name:
        return None
    path = resource_path("v1", "configmaps", namespace, conventions.state_configmap_name(name))
    try:
        configmap: Mapping[str, Any] = await api.get(path, what="read the applied record")
    except KubeNotFound:
        return None
    except KubeApiError as error:  # the plan is a courtesy: admit, say so in the log
        logger.warning("no plan for %s/%s: %s", namespace, name, error)
        return None
    state = await asyncio.to_thread(decode_state, configmap)
    return state.config if state is not None else None
