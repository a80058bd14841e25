"""A step's batch laid out for llama.cpp's micro-batches (engines/llamacpp/layout.py), on the real
engine: llama.cpp's own graph computes are counted (an eval callback on the final norm, computed
once per micro-batch), so these fail when a pass splits."""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Iterator
from typing import Any

import llama_cpp as lc
import numpy as np
import pytest

from engines.base import GenerationRequest, SamplingParams
from engines.llamacpp.engine import LlamaCppEngine
from engines.llamacpp.ggml_backends import ensure_loaded, ggml_lib
from engines.llamacpp.layout import Layout
from engines.llamacpp.runtime import LlamaCppOptions
from engines.llamacpp.slots import Slot
from gateway.models.registry import load_registry
from tests.conftest import ROOT

SEQS = 6


def _gguf() -> str:
    reg = load_registry(ROOT / "models.yaml")
    return str(reg.resolve(reg.models["smollm2-135m-instruct"], "gguf"))


class Counted:
    """A llama_context with one KV stream per sequence whose micro-batches are counted."""

    def __init__(self, model: Any) -> None:
        ggml = ggml_lib()
        ggml.ggml_get_name.restype, ggml.ggml_get_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
        self.passes = 0

        def seen(tensor: Any, ask: bool, _: Any) -> bool:
            if ask:
                return bool(ggml.ggml_get_name(tensor) == b"result_norm")
            self.passes += 1
            return True

        self._cb = lc.ggml_backend_sched_eval_callback(seen)  # kept alive with the context
        p = lc.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max, p.kv_unified = SEQS * 256, 64, 64, SEQS, False
        p.n_threads = p.n_threads_batch = 2
        p.op_offload = False
        p.cb_eval = self._cb
        self.ctx = lc.llama_init_from_model(model, p)
        self.mem = lc.llama_get_memory(self.ctx)
        self.batch = lc.llama_batch_init(64, 0, 1)
        self.slots = [Slot(seq_id=i) for i in range(SEQS)]
        self.layout = Layout(self.batch, 64, self.mem, self.slots, lc.llama_n_ctx_seq(self.ctx), sort=True, fill=True)

    def run(self, items: list[tuple[int, list[int]]], layout: bool) -> tuple[int, dict[int, np.ndarray]]:
        """Each sequence's tokens in this order (the last of each with logits): the micro-batches of
        the pass and each sequence's last logits."""
        n, outputs = 0, list[tuple[Slot, int, list[int]]]()
        for seq, tokens in items:
            slot = self.slots[seq]
            for i, t in enumerate(tokens):
                self.layout.put(n, seq, t, len(slot.cached), i == len(tokens) - 1)
                slot.cached.append(t)
                n += 1
            outputs.append((slot, n - 1, []))
        self.layout.sort = self.layout.fill = layout
        self.batch.n_tokens, outputs = self.layout.arrange(n, outputs)
        self.passes = 0
        assert lc.llama_decode(self.ctx, self.batch) == 0
        self.layout.restore()
        n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(lc.llama_get_model(self.ctx)))
        return self.passes, {s.seq_id: np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, i), shape=(n_vocab,)).copy()
                             for s, i, _ in outputs}

    def close(self) -> None:
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)


@pytest.fixture(scope="module")
def two() -> Iterator[tuple[Counted, Counted]]:
    """Two contexts in the same state: every sequence holds its own short prompt."""
    ensure_loaded()
    lc.llama_backend_init()
    mp = lc.llama_model_default_params()
    mp.n_gpu_layers = 0  # the CPU backend, whatever else the build has
    model = lc.llama_model_load_from_file(_gguf().encode(), mp)
    pair = (Counted(model), Counted(model))
    for c in pair:
        for s in range(SEQS):
            c.run([(s, [100 + s, 200 + s, 300 + s])], layout=False)
    yield pair
    for c in pair:
        c.close()
    lc.llama_model_free(model)


def _idle(c: Counted, *seqs: int) -> None:
    for s in c.slots:
        s.job = None if s.seq_id in seqs else object()  # type: ignore[assignment]


def test_streams_named_backwards_and_around_an_idle_sequence_run_as_one_micro_batch(two: tuple[Counted, Counted]) -> None:
    """Decoding sequences 4, 3, 1, 0 with 2 idle: llama.cpp takes a run of consecutive ids per
    micro-batch, in the batch's order, so as built that is four passes over the weights; in
    sequence order with a throwaway token on sequence 2 it is one, with the same logits, and
    sequence 2's KV ends where it did."""
    as_built, laid_out = two
    for c in two:
        _idle(c, 2, 5)
    before = lc.llama_memory_seq_pos_max(laid_out.mem, 2)
    step = [(4, [7]), (3, [8]), (1, [9]), (0, [10])]
    passes_built, want = as_built.run(step, layout=False)
    passes, got = laid_out.run(step, layout=True)
    assert (passes_built, passes) == (4, 1)
    assert lc.llama_memory_seq_pos_max(laid_out.mem, 2) == before
    assert laid_out.slots[2].cached == as_built.slots[2].cached
    for seq in want:
        np.testing.assert_allclose(got[seq], want[seq], atol=2e-3, rtol=0)


def test_a_prompt_chunk_beside_the_streams_takes_one_more_micro_batch_not_two(two: tuple[Counted, Counted]) -> None:
    """Sequences 0 and 2 decode while sequence 1 feeds an 8-token chunk: as built (the streams' tokens
    first) llama.cpp makes three micro-batches of it; in sequence order two (one token of each, then
    the chunk's rest), with the same logits. The next plain step's throwaway token is gone after it."""
    as_built, laid_out = two
    for c in two:
        _idle(c, 3, 4, 5)
    step = [(0, [11]), (2, [12]), (1, list(range(400, 408)))]
    passes_built, want = as_built.run(step, layout=False)
    passes, got = laid_out.run(step, layout=True)
    assert (passes_built, passes) == (3, 2)
    for seq in want:
        np.testing.assert_allclose(got[seq], want[seq], atol=2e-3, rtol=0)
    for c in two:
        _idle(c, 1, 3, 5)
    ends = [lc.llama_memory_seq_pos_max(laid_out.mem, s) for s in range(SEQS)]
    passes_built, want = as_built.run([(0, [13]), (2, [14]), (4, [15])], layout=False)
    passes, got = laid_out.run([(0, [13]), (2, [14]), (4, [15])], layout=True)
    assert (passes_built, passes) == (3, 1)
    assert [lc.llama_memory_seq_pos_max(laid_out.mem, s) for s in (1, 3, 5)] == [ends[1], ends[3], ends[5]]
    assert laid_out.layout.filled >= 3


async def _engine(monkeypatch: pytest.MonkeyPatch, layout: str) -> LlamaCppEngine:
    monkeypatch.setenv("GATEWAY_BATCH_LAYOUT", layout)
    e = LlamaCppEngine(LlamaCppOptions.engine_config(model_path=_gguf(), context_length=512, parallel=4,
                                                     device_sampling="on"))
    await e.load()
    return e


async def test_streams_that_finish_at_different_times_give_the_same_text_laid_out_or_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Four greedy streams on sequences 0-3 whose lengths differ, so that 1 and 2 go idle while 3 runs
    on (gaps filled) and later prompts start on low sequences beside running ones (sorted), with
    sampler chains on the device (an idle sequence keeps its chain for a while): the same tokens
    as without the layout."""
    lengths = (6, 12, 20, 48)
    reqs = [GenerationRequest("t", SamplingParams(temperature=0, max_tokens=k, ignore_eos=True), prompt=f"Story {i}:")
            for i, k in enumerate(lengths)]

    async def run(e: LlamaCppEngine, req: GenerationRequest, delay: float = 0.0) -> list[int]:
        await asyncio.sleep(delay)
        return [t async for ev in e.generate(req) for t in ev.token_ids]

    async def load(e: LlamaCppEngine) -> list[list[int]]:
        first = await asyncio.gather(*(run(e, r) for r in reqs))
        later = await asyncio.gather(run(e, reqs[3]), run(e, reqs[0], 0.3), run(e, reqs[1], 0.3))
        return [*first, *later]

    off = await _engine(monkeypatch, "off")
    try:
        want = await load(off)
    finally:
        await off.close()
    on = await _engine(monkeypatch, "on")
    try:
        assert await load(on) == want
        assert on._sched is not None and on._sched._layout.filled > 0 and on._sched._layout.sorted > 0
    finally:
        await on.close()
