"""Revisions, the canary and the watch of a live change, on a real Edge whose providers are real
upstream processes (`iop fake-upstream`, reached over sockets from nodes placed on the Edge),
with the official `openai` client as the load (each request its own conversation): a bad change
is rolled back by the Edge itself with (almost) nothing failing at the client, a good one
promoted through its steps, every change kept as a numbered revision that can be applied
again."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import openai
import orjson
import pytest

from iop.edge import EdgeServer
from iop.operator.adminapi import EdgeAdmin, apply_body
from iop.operator.errors import AdminRefused
from iop.operator.values import EdgeReplica
from iop.processes import UpstreamProcess, iop_command, spawn_fake_upstream
from testkit import CLIENT_TOKEN, edge_document, find_provider, provider

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

ADMIN_TOKEN = "rollout-admin-token"
#: Quick enough for a test, the rules otherwise the defaults.
ROLLOUT: dict[str, Any] = {
    "bake_ms": 2000,
    "min_requests": 10,
    "max_wait_ms": 8000,
    "steps": [10, 50, 100],
    "step_ms": 1000,
}


@pytest.fixture
async def upstreams() -> AsyncIterator[dict[str, UpstreamProcess]]:
    """served-a (model m's, which serves it as served-a2 too), served-b (model other's), and
    served-a again failing half its completions with a 500 (m's provider of last resort)."""
    async with contextlib.AsyncExitStack() as stack:
        yield {
            "a": await stack.enter_async_context(
                spawn_fake_upstream(["--model", "served-a", "--model", "served-a2"])
            ),
            "b": await stack.enter_async_context(spawn_fake_upstream(["--model", "served-b"])),
            "flaky": await stack.enter_async_context(
                spawn_fake_upstream(["--model", "served-a", "--fail-rate", "0.5", "--seed", "7"])
            ),
        }


def document(upstreams: dict[str, UpstreamProcess], tmp_path: Any) -> dict[str, Any]:
    def upstream(name: str) -> dict[str, Any]:
        return {"type": "openai", "base_url": upstreams[name].base_url}

    token_file = tmp_path / "admin.token"
    token_file.write_text(ADMIN_TOKEN)
    built = edge_document(
        {
            "local": [
                provider("pa", upstream("a"), served="served-a", capacity=4),
                provider("pf", upstream("flaky"), served="served-a", capacity=4, priority=50),
                provider("pb", upstream("b"), served="served-b", capacity=4),
            ]
        },
        {"m": ["pa", "pf"], "other": ["pb"]},
        placement="edge",
        admin=True,
    )
    built["edge"]["admin"]["token_file"] = str(token_file)
    built["rollout"] = dict(ROLLOUT)
    return built


class Load:
    """Clients sending requests for `models` back to back, each a conversation of its own
    (`conversations`: that many, taken in turn); each answer's (model, status), and the served
    name of each conversation's answers."""

    def __init__(self, url: str, models: list[str], conversations: int = 0) -> None:
        self.url, self.models = url, models
        self.answers: list[tuple[str, int]] = []
        self.served: dict[str, list[str]] = collections.defaultdict(list)
        self._conversations = conversations
        self._sent = 0
        self._done = asyncio.Event()

    async def _client(self, model: str) -> None:
        async with openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=CLIENT_TOKEN, max_retries=0
        ) as client:
            while not self._done.is_set():
                self._sent += 1
                number = self._sent % self._conversations if self._conversations else self._sent
                conversation = f"conversation {number}"
                try:
                    answer = await client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": conversation}]
                    )
                    self.answers.append((model, 200))
                    self.served[f"{model} {conversation}"].append(answer.model)
                except openai.APIStatusError as error:
                    self.answers.append((model, error.status_code))
                await asyncio.sleep(0.01)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Load]:
        tasks = [asyncio.create_task(self._client(m)) for m in self.models for _ in range(2)]
        try:
            yield self
        finally:
            self._done.set()
            await asyncio.gather(*tasks)

    def failed(self, model: str) -> int:
        return sum(1 for m, status in self.answers if m == model and status != 200)


@pytest.fixture
async def edge(
    start_edge: Callable[..., Awaitable[EdgeServer]], upstreams, tmp_path
) -> AsyncIterator[tuple[EdgeServer, dict[str, Any], httpx.AsyncClient]]:
    base = document(upstreams, tmp_path)
    server = await start_edge(base)
    assert server.admin_url is not None
    async with httpx.AsyncClient(
        base_url=server.admin_url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
    ) as admin:
        yield server, base, admin


async def apply(admin: httpx.AsyncClient, config: dict[str, Any]) -> dict[str, Any]:
    response = await admin.post("/refresh", json={"mode": "apply", "config": config})
    assert response.status_code == 200, response.text
    report: dict[str, Any] = response.json()
    assert report["applied"], report
    return report


async def revision(admin: httpx.AsyncClient, number: int) -> dict[str, Any]:
    listed = (await admin.get("/revisions")).json()["revisions"]
    return next(r for r in listed if r["revision"] == number)


async def ended(admin: httpx.AsyncClient, number: int, timeout: float = 20) -> dict[str, Any]:
    """Revision `number` once its watch is over."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        found = await revision(admin, number)
        if found["outcome"] != "watching":
            return found
        assert asyncio.get_running_loop().time() < deadline, found
        await asyncio.sleep(0.1)


def bad_changes() -> list[Any]:
    def served_name_missing(config: dict[str, Any]) -> None:
        # Valid (the provider says it serves the name) and wrong: the server answers 404.
        find_provider(config, "pa")["served_models"] = ["served-a", "served-x"]
        config["models"][0]["providers"] = {"pa": "served-x", "pf": "served-a"}

    def half_failing(config: dict[str, Any]) -> None:
        find_provider(config, "pf")["priority"] = 0  # now first, before pa
        find_provider(config, "pa")["priority"] = 60

    def all_to_the_flaky_one(config: dict[str, Any]) -> None:
        config["models"][0]["providers"] = {"pf": "served-a"}

    return [
        pytest.param(served_name_missing, "canary", id="served-name-missing"),
        pytest.param(half_failing, "watch", id="priority-to-a-failing-upstream"),
        pytest.param(all_to_the_flaky_one, "canary", id="model-moved-to-a-failing-upstream"),
    ]


@pytest.mark.parametrize(("change", "mode"), bad_changes())
async def test_a_bad_live_change_is_rolled_back_by_the_edge(edge, change, mode) -> None:
    """A change of what serves `m` takes a canary: a tenth of m's conversations, whose failed
    tries are tried again on the stable revision; a change of priorities alone applies to all
    at once and is watched. Either way the Edge rolls it back, and at most 2% of m's requests
    fail at the client."""
    server, base, admin = edge
    bad = copy.deepcopy(base)
    change(bad)
    async with Load(server.url, ["m", "other"]).running() as load:
        await asyncio.sleep(0.5)  # the stable revision's own figures
        report = await apply(admin, bad)
        assert report["revision"] == 2
        assert "on trial as revision 2" in report["message"]
        status = (await admin.get("/status")).json()["revisions"]
        if status["candidate"] is not None:  # (it may be over already)
            assert status["candidate"]["revision"] == 2
            assert status["candidate"]["mode"] == mode
        rolled = await ended(admin, 2)
        await asyncio.sleep(0.5)  # served by stable again
    answers = collections.Counter(load.answers)
    assert rolled["outcome"] == "rolled_back", (rolled["judgement"], answers)
    m_requests = sum(count for (model, _), count in answers.items() if model == "m")
    print(
        f"{mode}: rolled back {rolled['ended_at'] - rolled['applied_at']:.2f}s after the apply; "
        f"m failed {load.failed('m')} of {m_requests} at the client; answers {dict(answers)}"
    )
    assert load.failed("m") <= 0.02 * m_requests
    assert rolled["share_percent"] == (ROLLOUT["steps"][0] if mode == "canary" else None)
    assert rolled["judgement"]["check"] == "errors"
    assert rolled["touched_models"] == ["m"]
    assert rolled["judgement"]["candidate"]["requests"] >= ROLLOUT["min_requests"]
    assert server.refresher.current.config_hash == (await revision(admin, 1))["config_hash"]
    assert load.failed("other") == 0  # a model the change did not touch never noticed
    status = (await admin.get("/status")).json()["revisions"]
    assert (status["stable"]["revision"], status["candidate"]) == (1, None)
    last = (await admin.get("/refresh/last", params={"mode": "apply"})).json()
    assert last["source"] == "revision 1" and "rollback to revision 1" in last["requested_by"]
    # A caller that reapplies its desired config (the operator) cannot undo the rollback...
    again = await admin.post("/refresh", json={"mode": "apply", "config": bad})
    assert again.status_code == 409
    assert again.json()["outcome"] == "rolled_back"
    assert "rolled back as revision 2" in again.json()["message"]
    # ... until another config is applied; the same one after that is a new change again.
    off = copy.deepcopy(bad)
    off["rollout"]["mode"] = "off"
    assert (await apply(admin, off))["revision"] == 3


async def test_a_good_live_change_under_load_is_promoted_with_no_failed_request(edge) -> None:
    server, base, admin = edge
    good = copy.deepcopy(base)
    find_provider(good, "pa")["capacity"] = 6
    async with Load(server.url, ["m", "other"]).running() as load:
        await asyncio.sleep(0.5)
        report = await apply(admin, good)
        assert "all at once, watched, for m" in report["message"]
        promoted = await ended(admin, 2)
    assert promoted["outcome"] == "promoted", promoted
    assert promoted["judgement"]["check"] == "bake"
    assert load.failed("m") == load.failed("other") == 0
    listed = (await admin.get("/revisions")).json()
    assert (listed["stable"], listed["candidate"]) == (2, None)
    metrics = server.metrics.render().decode()
    assert 'iop_edge_revision{role="stable"} 2.0' in metrics
    assert 'iop_edge_revision{role="candidate"} 0.0' in metrics
    assert 'iop_edge_revisions_ended_total{outcome="promoted"} 1.0' in metrics


async def test_a_good_change_of_what_serves_a_model_goes_through_its_steps(edge) -> None:
    """m moves to another served name: a canary at 10%, 50%, 100% of m's conversations, each
    conversation sticking to its side (once on the candidate, never back), then promoted; no
    request fails, and the metrics count each revision's requests."""
    server, base, admin = edge
    good = copy.deepcopy(base)
    find_provider(good, "pa")["served_models"] = ["served-a", "served-a2"]
    good["models"][0]["providers"] = {"pa": "served-a2", "pf": "served-a"}
    shares: list[int] = []
    async with Load(server.url, ["m", "other"], conversations=40).running() as load:
        await asyncio.sleep(0.5)
        report = await apply(admin, good)
        assert "canary 10% -> 50% -> 100% for m" in report["message"]
        deadline = time.monotonic() + 60  # three steps of at most 8 s each, and the bake
        while candidate := (await admin.get("/status")).json()["revisions"]["candidate"]:
            # A canary that never ends shows where it stands, and how the load fared.
            assert time.monotonic() < deadline, (candidate, collections.Counter(load.answers))
            assert candidate["mode"] == "canary"
            if not shares or shares[-1] != candidate["share_percent"]:
                shares.append(candidate["share_percent"])
            await asyncio.sleep(0.05)
        promoted = await revision(admin, 2)
        await asyncio.sleep(0.3)
    assert promoted["outcome"] == "promoted", promoted
    assert promoted["judgement"]["check"] == "steps"
    assert shares == [10, 50, 100]
    assert load.failed("m") == load.failed("other") == 0
    for conversation, names in load.served.items():
        if conversation.startswith("m "):
            first = names.index("served-a2") if "served-a2" in names else len(names)
            assert set(names[first:]) <= {"served-a2"}, (conversation, names)
    metrics = server.metrics.render().decode()
    for side in ("stable", "candidate"):
        line = f'iop_edge_revision_requests_total{{model="m",revision="{side}"}}'
        assert float(metrics.split(line)[1].split()[0]) >= ROLLOUT["min_requests"]
    assert 'iop_edge_revision_first_token_seconds_bucket{le="+Inf",model="m"' in metrics


async def test_too_little_traffic_is_promoted_unjudged_and_says_so(edge) -> None:
    _, base, admin = edge
    quiet = copy.deepcopy(base)
    find_provider(quiet, "pa")["capacity"] = 5
    await apply(admin, quiet)
    unjudged = await ended(admin, 2)
    assert unjudged["outcome"] == "unjudged"
    assert "too little traffic to judge: 0 of 10" in unjudged["reason"]


async def test_a_change_that_serves_nothing_new_is_kept_unwatched(edge) -> None:
    _, base, admin = edge
    limits_only = copy.deepcopy(base)
    limits_only["openai"]["retries"] = {"max_per_request": 1}
    report = await apply(admin, limits_only)
    kept = await revision(admin, report["revision"])
    assert (kept["outcome"], kept["reason"]) == ("kept", "nothing served changed")


async def test_rollout_off_applies_and_keeps_as_before(edge) -> None:
    _, base, admin = edge
    off = copy.deepcopy(base)
    off["rollout"]["mode"] = "off"
    off["models"][0]["providers"] = {"pf": "served-a"}
    kept = await revision(admin, (await apply(admin, off))["revision"])
    assert (kept["outcome"], kept["reason"]) == ("kept", "rollout.mode is off")


async def test_a_watch_is_ended_by_hand_and_409_without_one(edge) -> None:
    server, base, admin = edge
    response = await admin.post("/rollout", json={"action": "promote"})
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "no_candidate"
    changed = copy.deepcopy(base)
    find_provider(changed, "pa")["capacity"] = 3
    await apply(admin, changed)
    aborted = await admin.post("/rollout", json={"action": "roll_back"})
    assert aborted.status_code == 200, aborted.text
    assert aborted.json()["outcome"] == "rolled_back"
    assert "by hand" in aborted.json()["reason"]
    assert server.refresher.current.config.nodes[0].providers[0].capacity == 4
    refused = await admin.post("/refresh", json={"mode": "apply", "config": changed})
    assert refused.status_code == 409  # rolled back by hand is rolled back too
    find_provider(changed, "pa")["capacity"] = 2
    await apply(admin, changed)
    promoted = await admin.post("/rollout", json={"action": "promote"})
    assert promoted.json()["outcome"] == "promoted"
    assert (await admin.get("/revisions")).json()["stable"] == 3
    bad = await admin.post("/rollout", json={"action": "restart"})
    assert bad.status_code == 400 and "action" in bad.json()["error"]["message"]


async def test_history_keeps_twenty_revisions_and_an_old_one_applies_again(edge) -> None:
    server, base, admin = edge
    for capacity in range(1, 26):  # 25 changes after the start: revisions 2..26
        changed = copy.deepcopy(base)
        changed["rollout"]["mode"] = "off"
        find_provider(changed, "pb")["capacity"] = capacity
        await apply(admin, changed)
    listed = (await admin.get("/revisions")).json()
    numbers = [r["revision"] for r in listed["revisions"]]
    assert numbers == list(range(26, 6, -1))  # newest first, the last 20
    assert {tuple(r["live_paths"]) for r in listed["revisions"]} == {
        ("nodes[local].providers[pb].capacity",)
    }
    assert len({r["config_hash"] for r in listed["revisions"]}) == 20
    # Revision 23 again, by its number: the Edge applies the config it keeps (the newest five
    # keep theirs, and the stable one).
    again = await admin.post("/refresh", json={"mode": "apply", "revision": 23})
    assert again.status_code == 200, again.text
    assert again.json()["source"] == "revision 23"
    assert server.refresher.current.config_hash == (await revision(admin, 23))["config_hash"]
    assert (await revision(admin, 27))["restores"] == 23
    for number, says in ((2, "keeps revisions 8-27"), (10, "the configs of 23, 24, 25, 26, 27")):
        gone = await admin.post("/refresh", json={"mode": "apply", "revision": number})
        assert gone.status_code == 404
        message = gone.json()["error"]["message"]
        assert f"revision {number} cannot be applied again here" in message and says in message


async def iop(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *iop_command(), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


async def test_iop_edge_history_and_rollout_against_the_admin_api(edge, tmp_path) -> None:
    server, base, admin = edge
    admin_args = ("--admin", server.admin_url, "--token-file", str(tmp_path / "admin.token"))
    changed = copy.deepcopy(base)
    find_provider(changed, "pa")["capacity"] = 2
    await apply(admin, changed)
    code, out, _ = await iop("edge", "history", *admin_args)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["REV", "HASH", "APPLIED", "OUTCOME"]
    assert lines[1].startswith("?   2  ") and "watching" in lines[1]
    assert "models: m; paths: nodes[local].providers[pa].capacity" in lines[1]
    assert lines[2].startswith("*   1  ") and "started" in lines[2]
    code, out, _ = await iop("edge", "rollout", "roll-back", *admin_args)
    assert (code, out.split(":")[0]) == (0, "revision 2")
    assert "rolled_back" in out
    code, _, err = await iop("edge", "rollout", "promote", *admin_args)
    assert code == 1 and "409" in err and "no change is being watched" in err
    code, out, _ = await iop("edge", "history", "--json", *admin_args)
    assert orjson.loads(out)["revisions"][0]["outcome"] == "rolled_back"
    code, _, err = await iop("edge", "history", "--admin", server.admin_url)
    assert code == 1 and "401" in err


async def test_the_operator_is_told_a_rolled_back_config_stays_rolled_back(edge) -> None:
    """What the operator's reapply of the EdgeConfig meets after the Edge rolled it back: a
    refusal that says so (not a restart to make), so the spec is never forced back in."""
    server, base, admin = edge
    changed = copy.deepcopy(base)
    find_provider(changed, "pa")["capacity"] = 3
    await apply(admin, changed)
    assert (await admin.post("/rollout", json={"action": "roll_back"})).status_code == 200
    replica = EdgeReplica("edge-0", "uid", server.admin_url or "", True, None)
    async with EdgeAdmin() as operator:
        with pytest.raises(AdminRefused) as refused:
            await operator.apply(replica, apply_body(changed, ()), ADMIN_TOKEN)
    assert refused.value.status == 409 and refused.value.restart_scopes == ()
    assert refused.value.rolled_back
    assert "rolled this config back" in refused.value.reason
    assert "revision 2" in refused.value.reason
