"""The engines' step trace (GATEWAY_STEP_TRACE): the real llama.cpp engine serving streams writes
every step, with its model pass and host work inside it, to a file Chrome's trace readers open;
the summary reads it back."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest

from engines import steptrace
from tests.conftest import ROOT
from tests.test_engine_llamacpp import _engine, _req, _run

sys.path.insert(0, str(ROOT / "benchmarks"))
import step_trace_summary  # noqa: E402


async def test_a_served_engine_traces_each_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_STEP_TRACE", str(tmp_path / "trace"))
    monkeypatch.setattr(steptrace, "_open", {})
    e = await _engine("smollm2-135m-instruct", parallel=3)
    try:
        # Two streams, and a third prompt arriving while they decode.
        async def late() -> tuple[list[int], str]:
            await asyncio.sleep(0.2)
            return await _run(e, _req("Write a long story about a cat. " * 8, max_tokens=8))

        done = await asyncio.gather(_run(e, _req("Count to twenty:", max_tokens=40)),
                                    _run(e, _req("Name some colours:", max_tokens=40)), late())
    finally:
        await e.close()
        steptrace._open[str(tmp_path / "trace")].close()
    (path,) = (tmp_path / "trace").glob("steps-*.json")
    text = path.read_text()
    assert text.startswith("[\n")
    json.loads(text.rstrip().rstrip(",") + "]")  # the array, closed, is JSON
    steps = step_trace_summary.steps_of(step_trace_summary.read_events(path))
    assert len(steps) >= 40
    assert all(s.start <= s.end and s.decode_ms > 0 for s in steps)
    # Each token after a stream's first (which its prompt's pass gives) is fed back in one step.
    assert sum(s.decoding for s in steps) == sum(len(toks) - 1 for toks, _ in done)
    assert any(s.prompt_tokens and s.decoding for s in steps)  # the late prompt prefilled beside them
    out = step_trace_summary.summarize(steps, client_p99=50.0)
    assert "worker gap between tokens: p50" in out and "after the worker" in out, out
    assert "decode-only steps (ms, whole step): p50" in out and "prompt tokens beside decoding: " in out, out


async def _stream_beside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, passes: int, tokens: int,
                         late: list[tuple[float, str, int]]) -> tuple[list[int], list[step_trace_summary.Step]]:
    """A traced engine (prefill budget 16, GATEWAY_PREFILL_PASSES=`passes`) streaming `tokens` tokens
    while the `late` prompts (delay, text, max_tokens) come: each request's tokens, and the steps."""
    monkeypatch.setenv("GATEWAY_STEP_TRACE", str(tmp_path / "trace"))
    monkeypatch.setenv("GATEWAY_PREFILL_PASSES", str(passes))
    monkeypatch.setattr(steptrace, "_open", {})
    e = await _engine("smollm2-135m-instruct", parallel=4, prefill_budget=16)
    try:
        async def after(delay: float, text: str, max_tokens: int) -> tuple[list[int], str]:
            await asyncio.sleep(delay)
            return await _run(e, _req(text, max_tokens=max_tokens))

        done = await asyncio.gather(_run(e, _req("Count to twenty:", max_tokens=tokens, ignore_eos=True)),
                                    *(after(*x) for x in late))
    finally:
        await e.close()
        steptrace._open[str(tmp_path / "trace")].close()
    (path,) = (tmp_path / "trace").glob("steps-*.json")
    return [len(toks) for toks, _ in done], step_trace_summary.steps_of(step_trace_summary.read_events(path))


@pytest.mark.parametrize("passes", [1, 4])
async def test_a_burst_of_prompts_beside_a_stream_takes_the_passes_it_may(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, passes: int) -> None:
    """GATEWAY_PREFILL_PASSES: beside a decoding stream a step feeds the prompts waiting in up to
    that many passes of the prefill budget (the stream waits for them once); 1 is one pass a step."""
    late = [(0.3, "Tell me about the sea. " * 6, 4), (0.3, "Name every planet you know. " * 6, 4)]
    counts, steps = await _stream_beside(tmp_path, monkeypatch, passes, 60, late)
    assert counts == [60, 4, 4]
    beside = [s for s in steps if s.decoding and s.prompt_tokens]
    fed = sum(s.prompt_tokens for s in beside)
    assert fed > 4 * 16  # the two prompts came while the stream decoded, in more than one pass's budget
    assert all(s.prompt_tokens <= 16 * passes and s.passes <= passes for s in beside)
    # The stream waited for as few steps as the passes allow (the prompts may come a step apart).
    assert len(beside) <= -(-fed // (16 * passes)) + 1
    if passes > 1:
        assert max(s.passes for s in beside) > 1


async def test_a_prompt_arriving_during_the_passes_joins_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that comes while a step runs its prompt passes is admitted between them (it does not
    wait for the step's end): the two prompts are fed in one step beside the stream."""
    import llama_cpp as lc

    decode = lc.llama_decode

    def slow(ctx: object, batch: object) -> int:  # every pass 30 ms longer: the second prompt surely comes mid-step
        time.sleep(0.03)
        return int(decode(ctx, batch))

    monkeypatch.setattr(lc, "llama_decode", slow)
    late = [(0.3, "Tell me everything about the sea and its tides. " * 16, 2), (0.4, "Name every planet you know. " * 6, 2)]
    counts, steps = await _stream_beside(tmp_path, monkeypatch, 32, 40, late)
    assert counts == [40, 2, 2]
    beside = [s for s in steps if s.decoding and s.prompt_tokens]
    assert len(beside) == 1 and beside[0].passes > 10, [(s.prompt_tokens, s.passes) for s in beside]


async def test_passes_end_when_those_admitted_between_them_are_more_than_the_plan_allows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GATEWAY_PASSES_STREAMS: a request admitted between a step's passes that puts more sequences in
    use than the plan allows ends the passes, and the prompts go one small chunk a step from there (a
    burst's arrivals are not all fed in the passes of the step that its first one began)."""
    import llama_cpp as lc

    decode = lc.llama_decode

    def slow(ctx: object, batch: object) -> int:  # every pass 30 ms longer: the second prompt surely comes mid-step
        time.sleep(0.03)
        return int(decode(ctx, batch))

    monkeypatch.setattr(lc, "llama_decode", slow)
    monkeypatch.setenv("GATEWAY_PASSES_STREAMS", "2")
    monkeypatch.setenv("GATEWAY_PREFILL_BUDGET_MANY", "8")
    # The first prompt's passes take at least 16 x 30 ms from when its step begins (by 0.55 s even on a
    # busy machine), so the second, 250 ms after it, comes while they run.
    late = [(0.3, "Tell me everything about the sea and its tides. " * 24, 2), (0.55, "Name every planet you know. " * 6, 2)]
    counts, steps = await _stream_beside(tmp_path, monkeypatch, 32, 40, late)
    assert counts == [40, 2, 2]
    beside = [(s.prompt_tokens, s.passes) for s in steps if s.decoding and s.prompt_tokens]
    assert beside[0][1] > 1, beside  # two sequences in use: the first prompt's step ran passes
    assert len(beside) > 1 and beside[1][0] <= 8 and beside[1][1] == 1, beside


async def test_beside_more_streams_than_the_plan_allows_a_step_takes_one_small_chunk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GATEWAY_PASSES_STREAMS / _PREFILL_BUDGET_MANY: with passes allowed while one sequence is in
    use, prompts beside two decoding streams go one chunk of the smaller budget a step."""
    monkeypatch.setenv("GATEWAY_PASSES_STREAMS", "1")
    monkeypatch.setenv("GATEWAY_PREFILL_BUDGET_MANY", "8")
    late = [(0.0, "Name some colours:", 70), (0.4, "Tell me about the sea. " * 6, 4),
            (0.4, "Name every planet you know. " * 6, 4)]
    counts, steps = await _stream_beside(tmp_path, monkeypatch, 4, 90, late)
    assert counts[0] == 90 and counts[2:] == [4, 4]
    many = [s for s in steps if s.decoding >= 2 and s.prompt_tokens]
    few = [s for s in steps if s.decoding == 1 and s.prompt_tokens]
    assert many, "no prompt came while two streams decoded: the test does not test the plan"
    assert all(s.prompt_tokens <= 8 and s.passes == 1 for s in many), [(s.prompt_tokens, s.passes) for s in many]
    assert all(s.prompt_tokens <= 16 * 4 for s in few)


@pytest.mark.parametrize(("backend", "env", "want"), [
    ("cuda", {}, (512, 8, 16, 128)),
    ("cpu", {}, (512, 1, 0, 128)),
    ("cuda", {"GATEWAY_PREFILL_PASSES": "2", "GATEWAY_PASSES_STREAMS": "0"}, (512, 2, 0, 128)),
    ("cpu", {"GATEWAY_PASSES_STREAMS": "4", "GATEWAY_PREFILL_BUDGET_MANY": "64"}, (512, 1, 4, 64)),
])
def test_the_prefill_plan_by_backend_and_settings(monkeypatch: pytest.MonkeyPatch, backend: str,
                                                   env: dict[str, str], want: tuple[int, ...]) -> None:
    from engines.llamacpp.load_settings import PrefillPlan, prefill_plan

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    plan = prefill_plan(backend, 512)
    assert (plan.budget, plan.passes, plan.streams, plan.many_budget) == want
    shared = prefill_plan(backend, 512, shared=True)  # one pass a step there: the whole budget unless asked
    assert shared.streams == (int(env["GATEWAY_PASSES_STREAMS"]) if "GATEWAY_PASSES_STREAMS" in env else 0)
    assert PrefillPlan(512, 8, 16, 128).for_step(16) == (512, 8)
    assert PrefillPlan(512, 8, 16, 128).for_step(17) == (128, 1)
    assert PrefillPlan(512, 8, 0, 128).for_step(64) == (512, 8)
    assert PrefillPlan(512, 8, 16).for_step(17) == (512, 1)
