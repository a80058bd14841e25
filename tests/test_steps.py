"""The per-token loop the step-at-a-time runtimes share, driven by a scripted model: end of
sequence, ignore_eos, stop strings across tokens, the token budget, resumed tokens and cancellation."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pytest

from engines.base import EngineClosed, SamplingParams, TokenEvent
from engines.bridge import Job
from engines.steps import StepPlan, run_steps

EOS = 0
PIECES = {0: "</s>", 1: "hel", 2: "lo", 3: " wor", 4: "ld", 5: "!"}
PROMPT = [7, 8, 9]


class Scripted:
    """Chooses `script` in order, records what it is fed and decodes through PIECES; cancels `job`
    once `cancel_fed` feeds or `cancel_chosen` choices are made."""

    def __init__(self, script: Sequence[int], job: Job[None] | None = None, cancel_fed: int = -1,
                 cancel_chosen: int = -1) -> None:
        self.script = list(script)
        self.fed: list[list[int]] = []
        self.chosen = 0
        self.decoded: list[int] = []
        self._job, self._cancel_fed, self._cancel_chosen = job, cancel_fed, cancel_chosen

    def feed(self, tokens: Sequence[int]) -> None:
        self.fed.append(list(tokens))
        if self._job is not None and len(self.fed) == self._cancel_fed:
            self._job.cancelled = True

    def next(self, logits: bool) -> tuple[int, npt.NDArray[np.float32] | None]:
        token = self.script[self.chosen]
        self.chosen += 1
        if self._job is not None and self.chosen == self._cancel_chosen:
            self._job.cancelled = True
        row = np.full(len(PIECES), -5.0, dtype=np.float32)
        row[token] = 5.0
        return token, row if logits else None

    def text(self, tokens: Sequence[int]) -> str:
        self.decoded += tokens
        return "".join(PIECES[t] for t in tokens)


def _job() -> Job[None]:
    return Job(run=lambda j: None, fail=lambda e: None)


def _run(script: Sequence[int], *, job: Job[None] | None = None, max_new: int = 10, resumed: tuple[int, ...] = (),
         replay: bool = True, steps: Scripted | None = None, **sp: object) -> tuple[list[TokenEvent | BaseException], Scripted]:
    job = job or _job()
    steps = steps or Scripted(script)
    out: list[TokenEvent | BaseException] = []
    plan = StepPlan(PROMPT, SamplingParams(**sp), max_new, resumed, replay)  # type: ignore[arg-type]
    run_steps(job, out.append, plan, steps, frozenset({EOS}), lambda t: PIECES[t].encode())
    return out, steps


def _events(out: list[TokenEvent | BaseException]) -> list[TokenEvent]:
    assert all(isinstance(e, TokenEvent) for e in out), out
    return [e for e in out if isinstance(e, TokenEvent)]


def test_eos_ends_with_stop_and_its_text_is_not_decoded() -> None:
    out, steps = _run([1, 2, EOS, 5])
    evs = _events(out)
    assert [(e.text, e.token_ids, e.finish_reason) for e in evs] == [("hel", (1,), None), ("lo", (2,), None),
                                                                      ("", (EOS,), "stop")]
    assert [e.prompt_tokens for e in evs] == [3, 0, 0]  # the first event alone carries the prompt size
    assert evs[-1].usage is not None and (evs[-1].usage.prompt_tokens, evs[-1].usage.completion_tokens) == (3, 3)
    assert evs[-1].usage.queue_seconds > 0 and evs[-1].stop_sequence is None
    assert steps.decoded == [1, 2] and steps.fed == [PROMPT]


def test_ignore_eos_decodes_eos_and_goes_on_to_the_limit() -> None:
    evs = _events(_run([1, EOS, 2, EOS], max_new=4, ignore_eos=True)[0])
    assert [e.text for e in evs] == ["hel", "</s>", "lo", "</s>"]
    assert [e.finish_reason for e in evs] == [None, None, None, "length"]
    assert evs[-1].usage is not None and evs[-1].usage.completion_tokens == 4


def test_a_stop_string_across_tokens_ends_the_text_before_it() -> None:
    evs = _events(_run([1, 2, 3, 4, 5], stop=("lo wo",))[0])
    # A tail that may begin the stop string is held back ("l", then "lo"), then cut at it.
    assert [(e.text, e.finish_reason) for e in evs] == [("he", None), ("l", None), ("", "stop")]
    assert evs[-1].stop_sequence == "lo wo" and evs[-1].token_ids == (3,)
    assert evs[-1].usage is not None and evs[-1].usage.completion_tokens == 3


def test_held_text_that_is_no_stop_is_released_at_the_limit() -> None:
    evs = _events(_run([1, 2], max_new=2, stop=("lo wo",))[0])
    assert [(e.text, e.finish_reason) for e in evs] == [("he", None), ("llo", "length")]
    assert evs[-1].stop_sequence is None


def test_logprobs_come_from_the_row_the_token_was_chosen_from() -> None:
    evs = _events(_run([1, 2], max_new=2, logprobs=True, top_logprobs=2)[0])
    assert [e.logprobs[0].token_id for e in evs] == [1, 2] and evs[0].logprobs[0].logprob > -1e-3
    assert len(evs[0].logprobs[0].top) == 2 and evs[0].logprobs[0].top[0].token_id == 1
    assert not _events(_run([1], max_new=1)[0])[0].logprobs


@pytest.mark.parametrize("replay", [True, False])
def test_resumed_tokens_are_fed_and_matched_but_not_emitted(replay: bool) -> None:
    out, steps = _run([3, 4, 5], resumed=(1, 2), replay=replay, max_new=4, stop=("lo wor",))
    evs = _events(out)
    # The stop string began in the resumed text ("lo"): it is still matched, and nothing is sent again.
    assert [(e.text, e.token_ids, e.finish_reason) for e in evs] == [("", (3,), "stop")]
    assert steps.fed == ([PROMPT, [1], [2]] if replay else [[*PROMPT, 1, 2]])
    assert steps.decoded == [1, 2, 3]
    evs = _events(_run([3, 4, 5], resumed=(1, 2), replay=replay, max_new=4)[0])
    assert [(e.text, e.prompt_tokens, e.finish_reason) for e in evs] == [(" wor", 3, None), ("ld", 0, "length")]
    assert evs[-1].usage is not None and evs[-1].usage.completion_tokens == 4  # resumed ones counted once


def test_a_cancelled_generation_stops_without_a_last_event() -> None:
    job = _job()
    out, _ = _run([1, 2, 3, 4], job=job, steps=Scripted([1, 2, 3, 4], job, cancel_chosen=2))
    assert [e.token_ids for e in _events(out)] == [(1,), (2,)]


def test_an_engine_closing_under_a_generation_ends_it_with_engine_closed() -> None:
    job = _job()
    job.closing = True
    out, _ = _run([1, 2, 3], job=job, steps=Scripted([1, 2, 3], job, cancel_chosen=1))
    assert isinstance(out[-1], EngineClosed) and len(out) == 2


def test_cancelled_while_replaying_emits_nothing() -> None:
    job = _job()
    job.closing = True
    steps = Scripted([3], job, cancel_fed=2)  # cancelled once the first resumed token is fed
    out, _ = _run([3], job=job, steps=steps, resumed=(1, 2))
    assert out == [] and steps.fed == [PROMPT, [1]] and steps.chosen == 0
