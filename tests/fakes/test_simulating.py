"""The simulated GPU server's model: its timings follow the mechanics it claims, on a clock of its
own (engine steps and their durations), so nothing here depends on the machine's speed."""

from __future__ import annotations

import pytest

from iop.fakes import GpuEngine, GpuSettings
from iop.fakes.simulating import SimRequest, render_answer, render_chat, token_count

SYSTEM = "You are a careful assistant who answers in full sentences. " * 40  # ~600 tokens


def run_until_first_token(engine: GpuEngine, request: SimRequest) -> float:
    """Simulated seconds from now until `request` gets its first token."""
    elapsed = 0.0
    while True:
        step = engine.step()
        assert step is not None, "the engine stopped before the request's first token"
        elapsed += step.duration_s
        if any(r is request for r, _ in step.tokens):
            return elapsed


def drain(engine: GpuEngine) -> float:
    elapsed = 0.0
    while (step := engine.step()) is not None:
        elapsed += step.duration_s
    return elapsed


def test_tokens_are_four_bytes_of_text() -> None:
    assert token_count(b"") == 0
    assert token_count(b"abcd") == 1
    assert token_count(b"abcde") == 2
    assert token_count("é".encode() * 4) == 2  # bytes of UTF-8, not characters


def test_a_repeated_prefix_is_prefilled_once() -> None:
    engine = GpuEngine(GpuSettings(step_ms=10, step_ms_per_seq=0, prefill_tokens_per_s=1000))
    prompt = render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a"}])
    cold = engine.submit(prompt, 4)
    cold_ttft = run_until_first_token(engine, cold)
    drain(engine)
    warm = engine.submit(prompt, 4)
    warm_ttft = run_until_first_token(engine, warm)
    drain(engine)
    assert cold.cached_tokens == 0
    # Every full block of the prompt was cached; only its tail is prefilled again.
    block = engine.settings.block_tokens
    assert warm.cached_tokens == token_count(prompt) // block * block
    assert warm_ttft < cold_ttft / 10, (cold_ttft, warm_ttft)
    assert engine.prefix_hits == warm.cached_tokens
    assert engine.prefix_queries == 2 * token_count(prompt)


def test_a_conversations_next_turn_hits_its_earlier_turn_and_answer() -> None:
    engine = GpuEngine(GpuSettings())
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first"}]
    answer = "The quick brown fox jumps over the lazy dog " * 10
    engine.submit(render_chat(messages), 90, render_answer(answer))
    drain(engine)
    messages += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "second"},
    ]
    prompt = render_chat(messages)
    # The next turn's prompt begins with the first turn's prompt and its stored answer.
    assert prompt.startswith(render_chat(messages[:2]) + render_answer(answer))
    turn = engine.submit(prompt, 4)
    run_until_first_token(engine, turn)
    block = engine.settings.block_tokens
    first_turn = token_count(render_chat(messages[:2]) + render_answer(answer))
    assert turn.cached_tokens >= first_turn // block * block


@pytest.mark.parametrize("batch", [2, 8, 16], ids=["batch-2", "batch-8", "batch-16"])
def test_a_fuller_batch_decodes_slower(batch: int) -> None:
    settings = GpuSettings(step_ms=20, step_ms_per_seq=2, max_batch=16)
    alone = GpuEngine(settings)
    alone.submit(b"x" * 64, 50)
    crowded = GpuEngine(settings)
    for _ in range(batch):
        crowded.submit(b"x" * 64, 50)
    # Past the prefill, a step is one token for every running request.
    for engine in (alone, crowded):
        engine.step()
    one = alone.step()
    many = crowded.step()
    assert one is not None and many is not None
    assert many.running == batch and one.running == 1
    assert many.duration_s == pytest.approx(one.duration_s + (batch - 1) * 0.002)
    assert many.duration_s > one.duration_s


def test_prefill_costs_the_tokens_not_in_the_cache() -> None:
    settings = GpuSettings(step_ms=10, step_ms_per_seq=0, prefill_tokens_per_s=1000)
    engine = GpuEngine(settings)
    request = engine.submit(b"y" * 4 * 400, 2)  # 400 tokens, no cache
    elapsed = run_until_first_token(engine, request)
    steps = -(-400 // settings.max_step_tokens)
    assert elapsed == pytest.approx(steps * 0.010 + 400 / 1000)


def test_the_batch_is_bounded_and_the_rest_waits() -> None:
    engine = GpuEngine(GpuSettings(max_batch=4))
    requests = [engine.submit(f"prompt {i}".encode(), 5) for i in range(7)]
    engine.step()
    assert (engine.running, engine.waiting) == (4, 3)
    drain(engine)
    assert all(r.done for r in requests)
    assert engine.finished == 7


def test_requests_wait_for_room_in_the_kv_cache() -> None:
    # Room for 4 requests of 64 tokens (prompt and answer), whatever the batch allows.
    engine = GpuEngine(GpuSettings(kv_tokens=256, block_tokens=16, max_batch=16))
    for i in range(6):
        engine.submit(f"{i:x}".encode() * 4 * 32, 32)
    engine.step()
    assert (engine.running, engine.waiting) == (4, 2)
    assert engine.kv_usage == pytest.approx(1.0)


def test_eviction_takes_the_least_recently_used_blocks() -> None:
    block_bytes = 16 * 4
    settings = GpuSettings(kv_tokens=16 * 12, block_tokens=16, step_ms_per_seq=0)
    engine = GpuEngine(settings)
    old = b"o" * block_bytes * 4
    recent = b"r" * block_bytes * 4
    for prompt in (old, recent):
        engine.submit(prompt, 1)
        drain(engine)
    engine.submit(recent, 1)  # used again: now the old prefix is the least recently used
    drain(engine)
    engine.submit(b"n" * block_bytes * 6, 1)  # needs room: some cached blocks must go
    drain(engine)
    assert engine.evictions > 0
    again_recent = engine.submit(recent, 1)
    drain(engine)
    again_old = engine.submit(old, 1)
    drain(engine)
    assert again_recent.cached_tokens == 4 * 16
    assert again_old.cached_tokens < 4 * 16


def test_the_same_seed_gives_the_same_steps_and_another_seed_does_not() -> None:
    def durations(seed: int) -> list[float]:
        engine = GpuEngine(GpuSettings(jitter=0.2, seed=seed))
        for i in range(20):
            engine.submit(f"{SYSTEM}{i % 3}".encode(), 10 + i)
        found = []
        while (step := engine.step()) is not None:
            found.append(step.duration_s)
        return found

    assert durations(7) == durations(7)
    assert durations(7) != durations(8)
    assert len(durations(7)) == len(durations(8))  # the jitter moves time, not the schedule


def test_a_cancelled_request_frees_what_it_held() -> None:
    engine = GpuEngine(GpuSettings(kv_tokens=1024))
    request = engine.submit(b"z" * 4 * 200, 100)
    engine.step()
    assert engine.kv_usage > 0
    engine.cancel(request)
    assert engine.running == 0
    assert engine.kv_usage == 0
    assert engine.step() is None


def test_metrics_use_vllms_names() -> None:
    engine = GpuEngine(GpuSettings(max_batch=1))
    for _ in range(2):
        engine.submit(b"q" * 4 * 64, 3)
    engine.step()
    text = engine.metrics_text("served").decode()
    labels = '{engine="0",model_name="served"}'
    assert f"vllm:num_requests_running{labels} 1" in text
    assert f"vllm:num_requests_waiting{labels} 1" in text
    assert f"vllm:kv_cache_usage_perc{labels} " in text
    assert f"vllm:prefix_cache_queries_total{labels} 64" in text
    assert f"vllm:prefix_cache_hits_total{labels} 0" in text
    assert "# TYPE vllm:prefix_cache_hits_total counter" in text


# -- LoRA adapters ---------------------------------------------------------------------------


def lora_engine(max_loras: int = 2, load_ms: float = 100.0, **settings: object) -> GpuEngine:
    return GpuEngine(
        GpuSettings(
            step_ms=10,
            step_ms_per_seq=0,
            prefill_tokens_per_s=1_000_000,
            lora_adapters="a,b,c",
            max_loras=max_loras,
            lora_load_ms=load_ms,
            **settings,  # type: ignore[arg-type]
        )
    )


def test_loading_an_adapter_stalls_the_step_that_admits_its_request() -> None:
    engine = lora_engine()
    base = engine.submit(b"x" * 64, 4)
    first = engine.step()
    assert first is not None and first.adapter_loads == 0
    lora = engine.submit(b"y" * 64, 4, adapter="a")
    step = engine.step()
    assert step is not None and step.adapter_loads == 1
    assert step.duration_s == pytest.approx(0.010 + 0.100, abs=0.001)
    drain(engine)
    # Loaded now: its next request pays nothing.
    again = engine.submit(b"z" * 64, 4, adapter="a")
    step = engine.step()
    assert step is not None and step.adapter_loads == 0
    assert step.duration_s == pytest.approx(0.010, abs=0.001)
    drain(engine)
    assert (engine.adapter_loads, engine.adapter_swaps) == (1, 0)
    assert all(r.done for r in (base, lora, again))


def test_a_request_waits_for_a_swap_while_every_slot_serves_others_and_later_ones_pass() -> None:
    engine = lora_engine(max_loras=1)
    long = engine.submit(b"a" * 64, 20, adapter="a")
    engine.step()
    blocked = engine.submit(b"b" * 64, 2, adapter="b")
    later = engine.submit(b"c" * 64, 2)  # the base model needs no slot: it runs at once
    also_a = engine.submit(b"d" * 64, 2, adapter="a")  # a is loaded: it runs at once too
    engine.step()
    assert engine.waiting == 1 and not blocked.prefill_left and blocked in engine._waiting
    assert engine.running_adapters() == ("a",) and engine.waiting_adapters() == ("b",)
    # b takes the slot once a's requests are gone: a swap (a out, b in).
    while not long.done:
        engine.step()
    step = engine.step()
    assert step is not None and step.adapter_loads == 1
    assert engine.loaded_adapters == ("b",)
    drain(engine)
    assert (engine.adapter_loads, engine.adapter_swaps) == (2, 1)
    assert later.done and also_a.done and blocked.done


def test_a_swap_evicts_the_least_recently_used_idle_adapter() -> None:
    engine = lora_engine(max_loras=2)
    for adapter in ("a", "b", "a"):  # b is now the least recently used
        engine.submit(b"p" * 64, 1, adapter=adapter)
        drain(engine)
    assert engine.loaded_adapters == ("b", "a")
    engine.submit(b"q" * 64, 1, adapter="c")
    drain(engine)
    assert engine.loaded_adapters == ("a", "c")
    assert (engine.adapter_loads, engine.adapter_swaps) == (3, 1)


def test_lora_requests_info_names_running_and_waiting_adapters() -> None:
    engine = lora_engine(max_loras=1)
    engine.submit(b"a" * 64, 20, adapter="a")
    engine.step()
    engine.submit(b"b" * 64, 2, adapter="b")
    engine.submit(b"c" * 64, 2, adapter="c")
    engine.step()
    text = engine.metrics_text("base", now=1764700000.5).decode()
    assert "# TYPE vllm:lora_requests_info gauge" in text
    assert (
        'vllm:lora_requests_info{max_lora="1",running_lora_adapters="a",'
        'waiting_lora_adapters="b,c"} 1764700000.5'
    ) in text
    assert "lora_requests_info" not in GpuEngine(GpuSettings()).metrics_text("base").decode()


def test_by_priority_the_queue_and_the_prefill_go_lowest_first_then_by_arrival() -> None:
    engine = GpuEngine(GpuSettings(max_batch=2, max_step_tokens=64, scheduling_policy="priority"))
    low = engine.submit(b"x" * 4 * 200, 3, priority=5)  # 200 tokens: 4 steps of prefill
    engine.step()
    assert low.prefill_left == 200 - 64
    # 40 tokens each: one step's budget prefills one of them and part of another.
    first, second = (
        engine.submit(b"a" * 160, 3, priority=1),
        engine.submit(b"b" * 160, 3, priority=1),
    )
    urgent = engine.submit(b"c" * 160, 3, priority=0)
    # The queue is urgent, first, second: urgent takes the free place, first takes low's
    # (preempted: it goes back to the queue, after second), and urgent is prefilled first.
    step = engine.step()
    assert step is not None
    assert [r for r, _ in step.tokens] == [urgent]
    assert (low.preempted, engine.preemptions, engine.running, engine.waiting) == (1, 1, 2, 2)
    served = []
    while (step := engine.step()) is not None:
        served += [r for r, count in step.tokens if r.produced == count]  # first tokens
    assert served.index(first) < served.index(second) < served.index(low)
    assert all(r.done for r in (low, first, second, urgent))


def test_a_preempted_request_recomputes_what_it_had_and_keeps_its_tokens() -> None:
    engine = GpuEngine(GpuSettings(max_batch=1, scheduling_policy="priority"))
    batch = engine.submit(b"p" * 4 * 100, 10, priority=1)
    for _ in range(4):  # its prefill, then three more tokens
        engine.step()
    assert batch.produced == 4
    urgent = engine.submit(b"q" * 4 * 10, 2, priority=0)
    step = engine.step()
    assert step is not None and [r for r, _ in step.tokens] == [urgent]
    assert batch.preempted == 1 and engine.waiting == 1
    drain(engine)
    # Back in the batch it prefilled again its prompt's uncached tokens and its 4 tokens, and
    # generated the 6 it had left: 10 in all, none twice.
    assert batch.produced == 10 and batch.done
    assert engine.prompt_tokens == 100 + 10  # each prompt counted once, as vLLM counts them


def test_a_preempted_request_goes_back_ahead_of_later_ones_of_its_priority() -> None:
    engine = GpuEngine(GpuSettings(max_batch=1, scheduling_policy="priority"))
    early = engine.submit(b"early", 5, priority=1)
    engine.step()
    late = engine.submit(b"late", 5, priority=1)
    urgent = engine.submit(b"urgent", 2, priority=0)
    finished: list[SimRequest] = []
    while (step := engine.step()) is not None:
        finished += step.finished
    assert finished == [urgent, early, late]
    assert early.preempted == 1 and late.preempted == 0


def test_first_come_first_served_never_preempts_and_refuses_a_priority() -> None:
    engine = GpuEngine(GpuSettings(max_batch=1))
    engine.submit(b"first", 5)
    engine.step()
    later = engine.submit(b"later", 1)
    engine.step()
    assert (engine.preemptions, later.produced) == (0, 0)
    with pytest.raises(ValueError, match="priority 3 without priority scheduling"):
        engine.submit(b"x", 1, priority=3)
    assert "vllm:num_preemptions_total" in engine.metrics_text("m").decode()


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        pytest.param({"max_batch": 0}, "max_batch must be >= 1", id="no-batch"),
        pytest.param(
            {"lora_adapters": "a,b"}, "lora_adapters need max_loras >= 1", id="adapters-no-slots"
        ),
        pytest.param({"max_loras": -1}, "max_loras and lora_load_ms", id="negative-slots"),
        pytest.param({"kv_tokens": 8}, "kv_tokens must be >= block_tokens", id="tiny-cache"),
        pytest.param({"jitter": 1.5}, "jitter must be in [0, 1)", id="jitter"),
        pytest.param({"max_step_tokens": 4}, "max_step_tokens must be >= max_batch", id="budget"),
        pytest.param(
            {"scheduling_policy": "lifo"}, "scheduling_policy must be fcfs or priority", id="policy"
        ),
    ],
)
def test_settings_that_cannot_work_are_refused(settings: dict[str, object], problem: str) -> None:
    with pytest.raises(ValueError, match=problem.replace("[", r"\[").replace(")", r"\)")):
        GpuSettings(**settings)  # type: ignore[arg-type]
