"""Sampler chains: built per request, and attached to a sequence to sample on the device.

llama.cpp can run a request's sampler chain inside the step's graph (on the device), so only the
sampled token comes back to the host. A chain stays on its sequence across requests with equal
chains (`sampler_key`): attaching one makes llama.cpp re-reserve its compute graphs.
"""

from __future__ import annotations

import ctypes
import logging
import time
from typing import Any

import llama_cpp as lc

from engines.base import SamplingParams
from engines.llamacpp.slots import GenJob, Job, Slot

log = logging.getLogger(__name__)

# Seconds an idle sequence keeps its device sampler chain. llama.cpp builds every attached chain
# into every step's graph (idle ones on a dummy row), so chains left on idle sequences slow down the
# few that run: on the H100 one stream fell from ~700 to ~600 tok/s after a 16-stream burst. Kept
# briefly, a busy server reuses them (attaching one costs a graph re-reserve).
IDLE_DETACH_S = 0.5

# Seconds a chain due to be attached (`DeviceSampler.attach_due`) waits while other requests are
# still before their first token. Attaching one re-reserves llama.cpp's compute graphs at the next
# pass (~46 ms for a Llama-3-8B-shaped model on the H100), a stall every request in that pass waits
# for: the request samples on the host until a pass with no first token to wait for, or this long.
ATTACH_DEFER_S = 0.25


class DeviceSampler:
    """Which sequences sample on the device, with which chain, attached when."""

    def __init__(self, ctx: Any, enabled: bool, defer: bool) -> None:
        self._ctx = ctx
        self.enabled = enabled  # off for good once the backend refuses a chain
        self._defer = defer  # whether a chain may be attached after the request's first tokens
        self.attaches = 0  # sampler chains attached to a sequence (each costs a graph reserve)
        self.deferred = 0  # of those, attached after the request's first tokens (`attach_due`)

    def place(self, slot: Slot, job: Job) -> None:
        """Sample `job` on the device when it can be, else make sure the sequence has no chain."""
        key = job.device_key if isinstance(job, GenJob) and self.enabled else None
        slot.on_device = slot.attach_due = False
        if key is not None and key == slot.device_key:
            lc.llama_sampler_reset(slot.device_chain)  # same chain, fresh state (penalties, seed)
            slot.on_device = True
            return
        if key is None:
            self.detach(slot)
            return
        assert isinstance(job, GenJob)
        sp = job.sampling
        if self._defer and slot.device_chain is None and (sp.temperature <= 0.0 or sp.seed is None):
            # Attached at the start of a later step (`attach_due`), not in this request's time to
            # its first token: its graph re-reserve would be. Until then the host samples. Not
            # for a seeded draw: the device's random stream would not go on from the host's, and
            # the same seed must give the same text.
            slot.attach_due = True
            return
        self.attach(slot)

    def attach_due(self, active: list[Slot]) -> None:
        """Attach the chains of running requests that sample on the host until then (`place`),
        all at once (one graph re-reserve), once no running request waits for its first token or
        the oldest has waited ATTACH_DEFER_S. Sampled on the host so far, a request's chain is a
        clone of its host chain, penalties' history and random state included: the tokens are
        those of a request sampled on one side only (greedy, or unseeded and so any draw)."""
        due = [s for s in active if s.attach_due]
        if not due:
            return
        first_waits = any(isinstance(s.job, GenJob) and s.pending is None for s in active)
        oldest = min(s.job.submitted for s in due if s.job is not None)
        if first_waits and time.perf_counter() - oldest < ATTACH_DEFER_S:
            return
        for slot in due:
            slot.attach_due = False
            if self.enabled:
                self.attach(slot)
                self.deferred += 1

    def attach(self, slot: Slot) -> None:
        """Attach a chain for the slot's job (replacing the one there) and sample on the device."""
        job = slot.job
        assert isinstance(job, GenJob)
        # A new chain for this sequence: a clone, since a chain can be attached only once and
        # the job's own copy stays usable on the host.
        chain = lc.llama_sampler_clone(job.sampler)
        if lc.llama_set_sampler(self._ctx, slot.seq_id, chain):
            self._drop(slot)
            slot.device_chain, slot.device_key, slot.on_device = chain, job.device_key, True
            self.attaches += 1
            return
        # The backend cannot run it (llama.cpp logs why): the host samples, from now on.
        lc.llama_sampler_free(chain)
        self._drop(slot)
        self.enabled = False
        log.warning("llama.cpp cannot sample on this device; sampling on the host")

    def detach(self, slot: Slot) -> None:
        """Take the sequence's chain off the context and free it."""
        if slot.device_chain is not None:
            lc.llama_set_sampler(self._ctx, slot.seq_id, None)
            self._drop(slot)

    def _drop(self, slot: Slot) -> None:
        if slot.device_chain is not None:
            lc.llama_sampler_free(slot.device_chain)
        slot.device_chain, slot.device_key, slot.on_device = None, None, False

    def detach_idle(self, slots: list[Slot]) -> float | None:
        """Detach the chains of sequences idle for IDLE_DETACH_S; seconds until the next is due."""
        now = time.perf_counter()
        due: float | None = None
        for slot in slots:
            if slot.job is None and slot.device_chain is not None:
                left = slot.idle_since + IDLE_DETACH_S - now
                if left <= 0:
                    self.detach(slot)
                else:
                    due = left if due is None else min(due, left)
        return due


def sampler_key(sp: SamplingParams, penalty_window: int) -> tuple[Any, ...]:
    """What `build_sampler` builds from `sp` without a grammar: equal keys, equal chains."""
    penalties = (sp.presence_penalty, sp.frequency_penalty, sp.repeat_penalty)
    return (
        sp.logit_bias, sp.ignore_eos,
        (*penalties, penalty_window) if penalties != (0.0, 0.0, 1.0) else None,
        (sp.temperature,) if sp.temperature <= 0.0 else (sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.seed),
    )


def build_sampler(
    vocab: Any,
    n_vocab: int,
    sp: SamplingParams,
    grammar: bytes | None,
    eog_ids: list[int],
    penalty_window: int,
    lazy_patterns: list[bytes] | None = None,
) -> Any:
    """A llama.cpp sampler chain for one request.  Returns None if the grammar does not parse."""
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    bias = list(sp.logit_bias)
    if sp.ignore_eos:
        bias += [(t, float("-inf")) for t in eog_ids]
    if bias:
        arr = (lc.llama_logit_bias * len(bias))()
        for i, (tok, b) in enumerate(bias):
            arr[i] = lc.llama_logit_bias(token=tok, bias=b)
        lc.llama_sampler_chain_add(
            chain, lc.llama_sampler_init_logit_bias(n_vocab, len(bias), arr)
        )
    if grammar is not None:
        if lazy_patterns:
            # The grammar applies from the first match of a pattern on; the text before is free.
            pats = (ctypes.c_char_p * len(lazy_patterns))(*lazy_patterns)
            g = lc.llama_sampler_init_grammar_lazy_patterns(vocab, grammar, b"root", pats, len(lazy_patterns), None, 0)
        else:
            g = lc.llama_sampler_init_grammar(vocab, grammar, b"root")
        if not g:
            lc.llama_sampler_free(chain)
            return None
        lc.llama_sampler_chain_add(chain, g)
    if sp.presence_penalty or sp.frequency_penalty or sp.repeat_penalty != 1.0:
        lc.llama_sampler_chain_add(
            chain,
            lc.llama_sampler_init_penalties(
                n_vocab, penalty_window, sp.repeat_penalty, sp.frequency_penalty, sp.presence_penalty
            ),
        )
    if sp.temperature <= 0.0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
        return chain
    if sp.top_k > 0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(sp.top_k))
    if sp.top_p < 1.0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(sp.top_p, 1))
    if sp.min_p > 0.0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_min_p(sp.min_p, 1))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(sp.temperature))
    seed = sp.seed if sp.seed is not None else lc.LLAMA_DEFAULT_SEED
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(seed & 0xFFFFFFFF))
    return chain
