"""Live config refresh: load, validate and classify a candidate config, then apply it copy-on-write.

Every way in goes through `Refresher.refresh` (the admin API's `POST /refresh`, SIGHUP in `iop
edge run`, `iop edge reload`), so they all validate, classify, log and report the same way: load
the candidate (a file only as `configfiles.ConfigFiles` allows, else `ConfigFileRefused`),
classify it against the config in use (a dry run stops there; an apply with a restart-required
path is refused unless the caller restarts that node itself: `restarting`), swap the next
`PoolSnapshot` into the dispatcher and the hub's snapshot in the same turn of the loop, push
changed payloads and collect the acks; a change becomes a revision, watched and rolled back when
it hurts (`rollouts.py`). Applies run one at a time; dry runs never wait for one. Loading,
classifying and building the snapshots (the pool's and the hub's) run in a worker thread: each
is a pure function of the configs, and a config of thousands of nodes takes the loop a second
or more, long enough for its Nodes to take the Edge for dead (their heartbeats wait meanwhile).
docs/refresh.md, "What an apply does", has each step and why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sized
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from iop.edgeconfig import (
    ChangeReport,
    ConfigError,
    EdgeConfig,
    Problem,
    Trial,
    classify,
    config_hash,
    load_data,
    load_text,
    node_payload,
    parse_yaml,
    plan_trial,
    require_token_hashes,
)
from iop.wire import ConfigAck

from ..hub import ConfigPush, NodeStatus, PreparedSwap
from ..pool import Dispatcher, OutcomeTally, PoolSnapshot
from .configfiles import ConfigFiles
from .reports import ConfigSource, Mode, NodePush, Outcome, RefreshReport
from .revisions import Revision
from .rollouts import Rollouts

logger = logging.getLogger(__name__)

#: How many paths a log line names before it says "and N more".
_LOGGED_PATHS = 12
_NOTHING_REPLACED: Mapping[str, Collection[str]] = MappingProxyType({})


class Refresher:
    """Dry runs and applies candidate configs; see the module docstring."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        *,
        hub: ConfigPush | None = None,
        config_path: str | Path | None = None,
        config_dir: str | Path | None = None,
        ack_timeout: float = 10.0,
        on_report: Callable[[RefreshReport], None] | None = None,
        outcomes: OutcomeTally | None = None,
    ) -> None:
        self._dispatcher = dispatcher
        #: Called with every report (the Edge counts them in its metrics).
        self._on_report = on_report
        self._hub = hub
        #: The file the Edge was started from: what SIGHUP and a body without a config re-read.
        self.config_path = Path(config_path).absolute() if config_path is not None else None
        #: The files a refresh may read.
        self.files = ConfigFiles(
            self.config_path, Path(config_dir) if config_dir is not None else None
        )
        self.ack_timeout = ack_timeout
        self._lock = asyncio.Lock()
        self._last: RefreshReport | None = None
        self._last_apply: RefreshReport | None = None
        #: The revisions, and the watch of a change (`outcomes`: what the requests came to).
        self.rollouts = Rollouts(dispatcher, outcomes, self._restore)
        self.rollouts.started(
            dispatcher.snapshot, f"file {self.config_path}" if self.config_path else "start"
        )

    @property
    def dispatcher(self) -> Dispatcher:
        """The dispatcher whose snapshot this refresher swaps."""
        return self._dispatcher

    @property
    def current(self) -> PoolSnapshot:
        """The config in use, with its hash and generation."""
        return self._dispatcher.snapshot

    def status(self) -> dict[str, Any]:
        """The config in use and, for every node of it, whether it runs that config's payload.

        What a caller that applied a config (the operator) reads to learn which nodes are
        current: connected, welcomed, and acknowledging the payload the config in use gives them.
        """
        current = self.current
        connected = self._hub.nodes() if self._hub is not None else {}
        digests = self._hub.payload_digests() if self._hub is not None else {}
        nodes: list[dict[str, Any]] = []
        for node in sorted(current.config.nodes, key=lambda n: n.id):
            status = connected.get(node.id)
            expected = digests.get(node.id, "")
            applied = status.applied_hash if status is not None else ""
            nodes.append(
                {
                    "node_id": node.id,
                    "connected": status is not None,
                    "ready": status is not None and status.ready,
                    "current": status is not None and status.ready and applied == expected,
                    "expected_hash": expected,
                    "applied_hash": applied,
                    "applied_generation": status.applied_generation if status is not None else 0,
                }
            )
        log = self.rollouts.log
        return {
            "config_hash": current.config_hash,
            "generation": current.generation,
            "revisions": {
                "stable": _role(log.stable),
                "candidate": _role(log.candidate),
            },
            "nodes": nodes,
            "served": self.rollouts.served(),
        }

    def last(self, mode: Mode | None = None) -> RefreshReport | None:
        """The most recent report (of `mode`, when given)."""
        return self._last_apply if mode == "apply" else self._last

    async def dry_run(self, candidate: ConfigSource, *, requested_by: str = "") -> RefreshReport:
        return await self.refresh("dry_run", candidate, requested_by=requested_by)

    async def apply(self, candidate: ConfigSource, *, requested_by: str = "") -> RefreshReport:
        return await self.refresh("apply", candidate, requested_by=requested_by)

    async def refresh(
        self,
        mode: Mode,
        candidate: ConfigSource,
        *,
        requested_by: str = "",
        restarting: Collection[str] = (),
        replacing: Mapping[str, Collection[str]] = _NOTHING_REPLACED,
    ) -> RefreshReport:
        """Load, validate and classify `candidate`; apply it too when `mode` is "apply".

        `restarting`: `node:<id>` scopes the caller restarts itself; their restart-required
        paths do not refuse the apply, and those nodes get no push. `replacing`: node id -> the
        instance ids of the processes its restart replaces, where the caller knows them; only
        those are held (any other process of the node is past its restart and gets the push).
        Raises `ConfigFileRefused` for a file a refresh may not read (nothing is reported).
        """
        clock = time.perf_counter()
        context: dict[str, Any] = {
            "mode": mode,
            "requested_by": requested_by,
            "source": candidate.describe(),
            "started_at": round(time.time(), 3),
            "restarting": tuple(sorted(set(restarting))),
        }
        try:
            config = await _load(candidate, self.files)
        except ConfigError as error:
            report = self._invalid(error, context)
        else:
            if mode == "dry_run":
                report = await asyncio.to_thread(self._judge, config, context)
            else:
                async with self._lock:
                    report = await self._apply(config, context, replacing=replacing)
        return self._finish(report, clock)

    async def _restore(
        self, stable: Revision, candidate: Revision, reason: str
    ) -> RefreshReport | None:
        """`Rollouts`' rollback: the stable revision's config applied in place of `candidate`,
        unless another change superseded that candidate first (None, nothing done)."""
        clock = time.perf_counter()
        async with self._lock:
            if self.rollouts.log.candidate is not candidate:
                return None
            assert stable.config is not None
            context: dict[str, Any] = {
                "mode": "apply",
                "requested_by": f"rollback to revision {stable.number}: {reason}",
                "source": f"revision {stable.number}",
                "started_at": round(time.time(), 3),
                "restarting": (),
            }
            report = await self._apply(stable.config, context, record=False)
        return self._finish(report, clock)

    def _finish(self, report: RefreshReport, clock: float) -> RefreshReport:
        report = _timed(report, clock)
        self._last = report
        if report.mode == "apply":
            self._last_apply = report
        _log(report)
        if self._on_report is not None:
            self._on_report(report)
        return report

    # -- the three outcomes ----------------------------------------------------------------------

    def _invalid(self, error: ConfigError, context: dict[str, Any]) -> RefreshReport:
        current = self.current
        count = len(error.problems)
        return RefreshReport(
            outcome="invalid",
            applied=False,
            previous_config_hash=current.config_hash,
            previous_generation=current.generation,
            config_hash=None,
            generation=current.generation,
            problems=error.problems,
            message=f"invalid: {count} problem{'s' if count != 1 else ''}; nothing changed",
            **context,
        )

    def _judge(self, config: EdgeConfig, context: dict[str, Any]) -> RefreshReport:
        """A dry run: what an apply would do."""
        current = self.current
        change = classify(current.config, config)  # (in a worker thread: see `refresh`)
        outcome: Outcome
        if _blocking(change, context["restarting"]):
            outcome, message = "restart_required", _restart_message(change, refused=False)
        elif not change.changed:
            outcome, message = "valid", "no change; an apply would push nothing"
        else:
            outcome = "valid"
            message = (
                f"{_count(change.live_paths, 'live path')} would apply; "
                f"{_count(change.nodes_to_push, 'node')} would get a push"
            )
        return RefreshReport(
            change=change,
            outcome=outcome,
            applied=False,
            previous_config_hash=current.config_hash,
            previous_generation=current.generation,
            config_hash=config_hash(config),
            generation=current.generation,
            message=message,
            **context,
        )

    async def _apply(
        self,
        config: EdgeConfig,
        context: dict[str, Any],
        *,
        record: bool = True,
        replacing: Mapping[str, Collection[str]] = _NOTHING_REPLACED,
    ) -> RefreshReport:
        """Swap `config` in and push it; with `record`, a change is a new revision (a rollback
        puts a revision back and records none)."""
        current = self.current
        change, prepared = await asyncio.to_thread(_classify, self._hub, current, config)
        held = _held_nodes(change, context["restarting"], replacing)
        refusal: tuple[Outcome, str] | None = None
        if _blocking(change, context["restarting"]):
            refusal = "restart_required", _restart_message(change, refused=True)
        elif record and (rolled_back := self.rollouts.refusal(config)):
            refusal = "rolled_back", f"{rolled_back}; nothing changed"
        if refusal is not None:
            return RefreshReport(
                change=change,
                outcome=refusal[0],
                applied=False,
                config_hash=config_hash(config),
                generation=current.generation,
                message=refusal[1],
                previous_config_hash=current.config_hash,
                previous_generation=current.generation,
                **context,
            )
        against = self.rollouts.stable_config()
        snapshot, planned = await asyncio.to_thread(
            _prepare, config, current.generation + 1, current.edge_replicas, against
        )
        replicas = self.current.edge_replicas
        if snapshot.edge_replicas != replicas:  # the Edge's peers changed meanwhile
            snapshot = snapshot.with_edge_replicas(replicas)
        # How the change goes on trial; an apply that changes nothing keeps the trial in
        # progress, a rollback (not recorded) ends it, and a change the caller restarts nodes
        # for is the restart's to roll out (the Edge could not put it back by itself).
        trial, split = self.rollouts.trial(snapshot, (against, planned))
        if not change.changed:
            split = self._dispatcher.split
        elif not record or change.restart_required_paths:
            split = None
        at_swap = self.rollouts.reading()  # a watch counts the requests from the swap on
        # The dispatcher's swap and the hub's (at the start of swap_config, before its first
        # await) happen in this same turn of the loop.
        self._dispatcher.swap(snapshot, split)
        pushes: tuple[NodePush, ...] = ()
        if self._hub is not None:
            acks = await self._hub.swap_config(
                config,
                generation=snapshot.generation,
                ack_timeout=self.ack_timeout,
                hold=held,
                prepared=prepared,
            )
            pushes = self._pushes(config, change, acks, snapshot.generation, held)
        report = RefreshReport(
            change=change,
            outcome="applied",
            applied=True,
            config_hash=snapshot.config_hash,
            generation=snapshot.generation,
            pushes=pushes,
            message=_applied_message(change, pushes, snapshot.generation),
            previous_config_hash=current.config_hash,
            previous_generation=current.generation,
            **context,
        )
        if not (record and change.changed):
            return report
        revision = self.rollouts.applied(report, snapshot, trial, split, at_swap)
        watched = ""
        if revision.outcome == "watching":
            watched = (
                f"; on trial as revision {revision.number} ({revision.plan}; rolled back if it "
                f"fails a check; {_trial_time(config, trial)})"
            )
        return replace(report, revision=revision.number, message=f"{report.message}{watched}")

    def _pushes(
        self,
        config: EdgeConfig,
        change: ChangeReport,
        acks: Mapping[str, ConfigAck | None],
        generation: int,
        held: Collection[str] = (),
    ) -> tuple[NodePush, ...]:
        """Each targeted node's result: the nodes whose payload changed, and any the hub found
        behind (a node that had not acknowledged an earlier push gets the current one too)."""
        assert self._hub is not None
        # Read only for a node that did not acknowledge: the status of every node costs a
        # look at each session, and an apply to thousands of nodes is usually acked by all.
        connected: Mapping[str, NodeStatus] | None = None
        results: list[NodePush] = []
        for node_id in sorted(set(change.nodes_to_push) | set(acks)):
            ack = acks.get(node_id)
            if ack is not None and ack.ok:
                reason = ""
                if ack.pending:
                    # The node serves several Edges that disagree for now (docs/reliability.md).
                    reason = (
                        "received; the node switches once every Edge it is connected to sends "
                        f"this payload (it runs {ack.in_use_hash[:12]} meanwhile)"
                    )
                results.append(NodePush(node_id, "acked", reason, generation, ack.config_hash))
                continue
            if connected is None:
                connected = self._hub.nodes()
            status = connected.get(node_id)
            payload = node_payload(config, node_id)  # the rarer outcomes name the digest too
            digest = payload.digest if payload is not None else ""
            if node_id in held and node_id not in acks:
                reason = "held for its restart; it receives this payload when it connects again"
                push = NodePush(node_id, "held", reason, generation, digest)
            elif ack is not None:
                push = NodePush(node_id, "failed", ack.error or "refused", generation, digest)
            elif node_id in acks and status is None:
                reason = "disconnected before acknowledging"
                push = NodePush(node_id, "failed", reason, generation, digest)
            elif node_id in acks:
                reason = f"no acknowledgement within {self.ack_timeout:g}s"
                push = NodePush(node_id, "failed", reason, generation, digest)
            elif status is not None and status.ready and status.applied_hash == digest:
                reason = "had this payload already (it connected during the apply)"
                push = NodePush(node_id, "acked", reason, status.applied_generation, digest)
            else:
                reason = "not connected; it receives the current payload when it connects"
                push = NodePush(node_id, "not_connected", reason, generation, digest)
            results.append(push)
        return tuple(results)


def _role(revision: Revision | None) -> dict[str, Any] | None:
    """A revision as `/status` names it."""
    if revision is None:
        return None
    role: dict[str, Any] = {"revision": revision.number, "config_hash": revision.config_hash}
    if revision.outcome == "watching":
        role["mode"] = "canary" if revision.share is not None else "watch"
        role["share_percent"] = revision.share
    return role


def _trial_time(config: EdgeConfig, trial: Trial) -> str:
    """About how long the trial takes with enough traffic, and at most."""
    usual, longest = trial.duration_s(config)
    return (
        f"about {usual:g}s with {config.rollout.min_requests} requests judged, at most {longest:g}s"
    )


def _blocking(change: ChangeReport, restarting: Collection[str]) -> bool:
    """Whether a restart-required path of `change` is not in a scope the caller restarts."""
    return any(path.scope not in restarting for path in change.restart_required_paths)


def _held_nodes(
    change: ChangeReport, restarting: Collection[str], replacing: Mapping[str, Collection[str]]
) -> dict[str, frozenset[str]]:
    """The nodes of the `node:<id>` scopes the caller restarts (they get no push), each with
    the processes its restart replaces (empty: not known)."""
    nodes = {
        path.scope.removeprefix("node:")
        for path in change.restart_required_paths
        if path.scope in restarting and path.scope.startswith("node:")
    }
    return {node: frozenset(replacing.get(node, ())) for node in nodes}


def _classify(
    hub: ConfigPush | None, current: PoolSnapshot, config: EdgeConfig
) -> tuple[ChangeReport, PreparedSwap | None]:
    """The classification of `config` against the config in use, and the hub's swap of it
    prepared beside it, whose payloads the classification reuses (each node's payload is
    built once per apply): run in a worker thread."""
    if hub is None:
        return classify(current.config, config), None
    prepared = hub.prepare(config, current.generation + 1)
    payloads = None
    if prepared.replaces is current.config:  # (the hub swaps with the dispatcher: always so)
        payloads = (prepared.replaced_payloads, prepared.payloads)
    return classify(current.config, config, payloads=payloads), prepared


def _prepare(
    config: EdgeConfig, generation: int, edge_replicas: int, stable: EdgeConfig
) -> tuple[PoolSnapshot, Trial]:
    """The pool snapshot of `config` and its trial against `stable`: pure functions of the
    configs, run in a worker thread (at thousands of nodes, tens of milliseconds each)."""
    return PoolSnapshot.build(config, generation, edge_replicas), plan_trial(stable, config)


async def _load(candidate: ConfigSource, files: ConfigFiles) -> EdgeConfig:
    """The candidate as a valid config the Edge can run, or `ConfigError`; reading and parsing
    run off the event loop. A file is read through `files` (or `ConfigFileRefused`).

    A config model passed in is validated again (as a document): one built with `model_copy`
    never went through the checks between values.
    """
    if candidate.path is not None:
        text = await asyncio.to_thread(files.read, candidate.path)
        config = await asyncio.to_thread(_load_file_text, text)
    elif candidate.text is not None:
        config = await asyncio.to_thread(load_text, candidate.text)
    else:
        data = candidate.data
        if isinstance(data, EdgeConfig):
            data = data.model_dump(mode="json")
        config = await asyncio.to_thread(load_data, data)
    require_token_hashes(config)
    return config


def _load_file_text(text: str) -> EdgeConfig:
    """A file's config; a file that is not an EdgeConfig document at all (no `edge` section)
    gets one problem that says so, without echoing any of its lines or values."""
    document = parse_yaml(text)
    if not isinstance(document, Mapping) or "edge" not in document:
        raise ConfigError([Problem("", "the file is not an EdgeConfig document (no edge section)")])
    return load_data(document)


def _timed(report: RefreshReport, clock: float) -> RefreshReport:
    return replace(report, duration_ms=round((time.perf_counter() - clock) * 1000, 3))


def _count(items: Sized, noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def _paths(paths: list[str]) -> str:
    shown = ", ".join(paths[:_LOGGED_PATHS])
    more = len(paths) - _LOGGED_PATHS
    return f"{shown} and {more} more" if more > 0 else shown


def _restart_message(change: ChangeReport, *, refused: bool) -> str:
    paths = [p.path for p in change.restart_required_paths]
    head = f"{_count(paths, 'restart-required path')} ({_paths(paths)})"
    if refused:
        return f"refused: {head}; nothing changed"
    return f"{head}; an apply would be refused"


def _applied_message(change: ChangeReport, pushes: tuple[NodePush, ...], generation: int) -> str:
    if not change.changed:
        return f"no change; generation {generation} swapped in, nothing pushed"
    tally = {
        status: sum(push.status == status for push in pushes)
        for status in ("acked", "failed", "not_connected", "held")
    }
    sent = len(pushes) - tally["held"]
    pushed = (
        f"pushed to {sent} node{'' if sent == 1 else 's'}: {tally['acked']} acked, "
        f"{tally['failed']} failed, {tally['not_connected']} not connected"
        if sent
        else "nothing to push"
    )
    if tally["held"]:
        pushed += f"; {tally['held']} held for restart"
    restarts = len(change.restart_required_paths)
    live = _count(change.live_paths, "live path")
    if restarts:
        live += f", {_count(change.restart_required_paths, 'path')} for the caller's restarts"
    return f"applied generation {generation}: {live}; {pushed}"


def _log(report: RefreshReport) -> None:
    """Who, what and which hashes; never a config value (only paths and hashes)."""
    paths = [*report.change.live_paths, *(p.path for p in report.change.restart_required_paths)]
    paths += [p.path for p in report.problems]
    failed = [f"{p.node_id} ({p.status}: {p.reason})" for p in report.pushes if p.status != "acked"]
    level = logging.INFO
    if report.mode == "apply" and (not report.applied or failed):
        level = logging.WARNING
    logger.log(
        level,
        "refresh %s by %s from %s: %s; hash %s -> %s; generation %d -> %d; paths: %s%s",
        report.mode,
        report.requested_by or "(unknown)",
        report.source,
        report.message,
        report.previous_config_hash[:12],
        (report.config_hash or "-")[:12],
        report.previous_generation,
        report.generation,
        _paths(paths) or "(none)",
        f"; not acked: {', '.join(failed)}" if failed else "",
    )
