"""Parity: compare a candidate engine's next-token distributions with a reference engine's.

For each prompt the reference generates a greedy continuation; both engines are then
teacher-forced on the same tokens (prompt + continuation) through `Engine.logits`, and their
distributions are compared at every continuation position: KL(reference || candidate), top-1
agreement, top-k overlap, the largest logit difference over the reference's top-k, and each
engine's perplexity on the continuation.  The candidate also decodes greedily, and the first
divergence is judged by vLLM's `check_logprobs_close` rule: tokens are equal until they diverge,
and at the divergence each side's token is in the other's top-k.

Everything here works on the `Engine` protocol; only `open_engine` knows how an engine is chosen
and built, so that one function can follow changes in selection.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from engines.base import Engine, EngineError, GenerationRequest, SamplingParams
from engines.runtimes import in_one_process, runtimes
from gateway.host.hardware import HostCapabilities, probe_host, vulkan_visible_env
from gateway.host.selection import Preference, SelectionError, plan
from gateway.models.pool import engine_config, local_engine
from gateway.models.registry import ModelSpec, ModelUnavailable, ParityTolerance, Registry
from gateway.settings import Settings

log = logging.getLogger(__name__)

DEFAULT_TOP_K = 5
DEFAULT_TOKENS = 32

# Short, varied, multilingual; raw prompts (no chat template) so any model and engine can run them.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "La photosynthèse est le processus par lequel",
    "Die drei wichtigsten Erfindungen des 20. Jahrhunderts sind",
    "1, 1, 2, 3, 5, 8, 13,",
)

FloatArray = npt.NDArray[np.float64]

# (reference backend, candidate backend, precision) -> limits; first match wins, "*" matches any.
# Modelled on ONNX Runtime's parity tests: CPU 1e-5, CUDA 1e-4, FP16 1e-2 absolute logit
# difference.  Quantised weights are judged by KL / top-1 / perplexity ratio: different kernels
# dequantise in different orders, so single logits move while the distribution barely does.
# llama.cpp's GPU kernels (Vulkan, CUDA) accumulate in fp16 and take other matmul paths: on the
# 135M Q4_1 model, measured against the CPU engine, lavapipe gives mean KL 0.003-0.010 and top-1
# 0.75-0.92 over 12-16 positions, the H100 mean KL 0.026 (worst prompt 0.063), max 1.45, top-1
# 0.95, perplexity ratio 1.02 (worst prompt 1.11). A broken kernel or a wrong quantisation is
# far outside this: Q4_1 requantised to Q4_0 gives mean KL 0.40 and perplexity ratio 1.55.
# Top-1 is a weak signal on this tiny model: near-ties flip (lavapipe: 5 of 8 on one French
# prompt at mean KL 0.016), so KL, perplexity and the divergence rule carry the verdict.
GPU_VS_CPU_QUANT = ParityTolerance(max_mean_kl=0.1, max_kl=2.0, min_top1=0.5, max_ppl_ratio=1.15)

# Two GPU builds against each other (both fp16 accumulation, different kernels): on the H100, the
# Vulkan build against the CUDA build over 6 prompts x 32 tokens measured mean KL 0.024 (worst
# prompt 0.041), max KL 0.425, top-1 0.911 (worst prompt 0.81) and perplexity ratio 1.05 at worst:
# further apart than either is from the CPU (Vulkan-CPU mean KL 0.0055, CUDA-CPU 0.024). The limits
# leave about 2x room over the worst prompt; Q4_0-for-Q4_1 (mean KL 0.40) stays far outside.
GPU_VS_GPU_QUANT = ParityTolerance(max_mean_kl=0.08, max_kl=1.0, min_top1=0.7, max_ppl_ratio=1.1)

# (reference, candidate, precision class) -> limits; an engine ("cpu") or a runtime's label ("llamacpp/cpu").
_SAME_ENGINE: tuple[tuple[tuple[str, str, str], ParityTolerance], ...] = (
    (("cpu", "cpu", "quant"), ParityTolerance(max_mean_kl=1e-6, max_kl=1e-5, min_top1=1.0, max_ppl_ratio=1.0001)),
    (("cpu", "cpu", "*"), ParityTolerance(max_abs_logit=1e-5, min_top1=1.0)),
)
# The rows below a runtime's own (engines/runtimes.py `tolerances`), which come first.
_GENERIC: tuple[tuple[tuple[str, str, str], ParityTolerance], ...] = (
    (("cpu", "vulkan", "quant"), GPU_VS_CPU_QUANT),
    (("cpu", "cuda", "quant"), GPU_VS_CPU_QUANT),
    (("cuda", "vulkan", "quant"), GPU_VS_GPU_QUANT),
    (("vulkan", "cuda", "quant"), GPU_VS_GPU_QUANT),
    (("*", "*", "quant"), ParityTolerance(max_mean_kl=5e-3, max_kl=0.1, min_top1=0.95, max_ppl_ratio=1.02)),
    (("*", "*", "f16"), ParityTolerance(max_abs_logit=1e-2, min_top1=0.99)),
    (("*", "*", "*"), ParityTolerance(max_abs_logit=1e-4, min_top1=0.99)),
)


def tolerances() -> tuple[tuple[tuple[str, str, str], ParityTolerance], ...]:
    """The table, first match wins: the same engine, then each runtime's own rows, then the rest."""
    own = tuple((key, ParityTolerance(**limits)) for rt in runtimes() for key, limits in rt.tolerances)
    return _SAME_ENGINE + own + _GENERIC


class ParityError(Exception):
    """The comparison cannot run (an engine cannot load, the vocabularies differ, ...)."""


class VocabularyMismatch(ParityError):
    """The two engines do not share a vocabulary, so token ids cannot be compared."""


# --- tolerances ----------------------------------------------------------------------------


def precision_class(*precisions: str) -> str:
    """The coarsest of the weights' precisions: "quant", "f16" or "f32"."""
    out = "f32"
    for p in precisions:
        p = p.lower()
        if p not in ("f32", "f16", "bf16"):
            return "quant"
        if p in ("f16", "bf16"):
            out = "f16"
    return out


def tolerance_for(
    reference: str, candidate: str, precision: str, override: ParityTolerance | None = None
) -> ParityTolerance:
    """The table's limits for this comparison, with the model's `parity:` fields on top."""
    base = ParityTolerance()
    for (r, c, p), tol in tolerances():
        if r in ("*", reference) and c in ("*", candidate) and p in ("*", precision):
            base = tol
            break
    if override is None:
        return base
    return base.model_copy(update=override.model_dump(exclude_none=True))


# --- the math ------------------------------------------------------------------------------


def log_softmax(logits: npt.ArrayLike) -> FloatArray:
    """Row-wise log-probabilities, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))  # type: ignore[no-any-return]


def kl_divergence(ref_logits: npt.ArrayLike, cand_logits: npt.ArrayLike) -> FloatArray:
    """KL(reference || candidate) in nats for each row."""
    lp, lq = log_softmax(ref_logits), log_softmax(cand_logits)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    return np.maximum(kl, 0.0)  # type: ignore[no-any-return]


def top_k_ids(logits: npt.ArrayLike, k: int) -> npt.NDArray[np.int64]:
    """The k highest-scoring token ids of each row, best first."""
    x = np.atleast_2d(np.asarray(logits))
    k = min(k, x.shape[-1])
    ids = np.argpartition(-x, k - 1, axis=-1)[:, :k]
    order = np.argsort(-np.take_along_axis(x, ids, axis=-1), axis=-1, kind="stable")
    return np.take_along_axis(ids, order, axis=-1).astype(np.int64)


def nll(logits: npt.ArrayLike, targets: Sequence[int]) -> FloatArray:
    """Negative log-likelihood of `targets[i]` under row i."""
    lp = log_softmax(logits)
    out: FloatArray = -lp[np.arange(len(targets)), np.asarray(targets, dtype=np.int64)]
    return out


@dataclass(frozen=True)
class PositionStats:
    """Per-position comparison of two engines' logits at the same positions."""

    kl: FloatArray
    top1: npt.NDArray[np.bool_]
    topk_overlap: FloatArray
    max_abs_logit: FloatArray
    nll_ref: FloatArray
    nll_cand: FloatArray
    top_ref: npt.NDArray[np.int64]
    top_cand: npt.NDArray[np.int64]


def compare_logits(
    ref_logits: npt.ArrayLike, cand_logits: npt.ArrayLike, targets: Sequence[int], k: int = DEFAULT_TOP_K
) -> PositionStats:
    """Compare rows of logits (one per position) predicting `targets`."""
    ref = np.asarray(ref_logits, dtype=np.float64)
    cand = np.asarray(cand_logits, dtype=np.float64)
    if ref.shape[-1] != cand.shape[-1]:
        raise VocabularyMismatch(
            f"the engines' vocabularies differ: {ref.shape[-1]} vs {cand.shape[-1]} tokens"
        )
    top_ref, top_cand = top_k_ids(ref, k), top_k_ids(cand, k)
    overlap = np.array([len(set(a) & set(b)) / top_ref.shape[1] for a, b in zip(top_ref, top_cand, strict=True)])
    diff = np.abs(np.take_along_axis(ref, top_ref, axis=-1) - np.take_along_axis(cand, top_ref, axis=-1))
    return PositionStats(
        kl=kl_divergence(ref, cand),
        top1=top_ref[:, 0] == top_cand[:, 0],
        topk_overlap=overlap,
        max_abs_logit=diff.max(axis=-1),
        nll_ref=nll(ref, targets),
        nll_cand=nll(cand, targets),
        top_ref=top_ref,
        top_cand=top_cand,
    )


@dataclass(frozen=True)
class Divergence:
    """Where greedy decodes first differ, and whether vLLM's top-k rule holds there."""

    position: int | None  # index into the continuation; None when the decodes agree throughout
    ref_token: int | None = None
    cand_token: int | None = None
    within_top_k: bool = True


def first_divergence(
    ref_tokens: Sequence[int],
    cand_tokens: Sequence[int],
    top_ref: npt.NDArray[np.int64],
    top_cand: npt.NDArray[np.int64],
) -> Divergence:
    """vLLM's `check_logprobs_close`: equal until they diverge; there, each token in the other's top-k.

    `top_ref[i]` / `top_cand[i]` are each engine's top-k at continuation position i on the shared
    prefix (identical for both up to the divergence, so teacher-forced rows are exact).
    """
    n = min(len(ref_tokens), len(cand_tokens))
    for i in range(n):
        r, c = int(ref_tokens[i]), int(cand_tokens[i])
        if r != c:
            ok = i < len(top_ref) and c in top_ref[i] and r in top_cand[i]
            return Divergence(i, r, c, bool(ok))
    if len(ref_tokens) != len(cand_tokens):  # one stopped without an end token of its own
        return Divergence(n, None, None, False)
    return Divergence(None)


# --- reports ------------------------------------------------------------------------------


@dataclass
class Scores:
    """Aggregates over some continuation positions."""

    positions: int
    mean_kl: float
    max_kl: float
    top1: float
    topk_overlap: float
    max_abs_logit: float
    ppl_ref: float
    ppl_cand: float

    @classmethod
    def of(cls, stats: Sequence[PositionStats]) -> Scores:
        def cat(name: str) -> FloatArray:
            return np.concatenate([np.asarray(getattr(s, name), dtype=np.float64) for s in stats])

        kl = cat("kl")
        if kl.size == 0:
            return cls(0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0)
        return cls(
            positions=int(kl.size),
            mean_kl=float(kl.mean()),
            max_kl=float(kl.max()),
            top1=float(cat("top1").mean()),
            topk_overlap=float(cat("topk_overlap").mean()),
            max_abs_logit=float(cat("max_abs_logit").max()),
            ppl_ref=float(math.exp(cat("nll_ref").mean())),
            ppl_cand=float(math.exp(cat("nll_cand").mean())),
        )

    def violations(self, tol: ParityTolerance) -> list[str]:
        """Why these scores are outside `tol` (empty when within)."""
        out = []
        if tol.max_abs_logit is not None and self.max_abs_logit > tol.max_abs_logit:
            out.append(f"max |dlogit| {self.max_abs_logit:.3g} > {tol.max_abs_logit:g}")
        if tol.max_mean_kl is not None and self.mean_kl > tol.max_mean_kl:
            out.append(f"mean KL {self.mean_kl:.3g} > {tol.max_mean_kl:g}")
        if tol.max_kl is not None and self.max_kl > tol.max_kl:
            out.append(f"max KL {self.max_kl:.3g} > {tol.max_kl:g}")
        if tol.min_top1 is not None and self.top1 < tol.min_top1:
            out.append(f"top-1 agreement {self.top1:.3f} < {tol.min_top1:g}")
        if tol.max_ppl_ratio is not None and self.positions:
            ratio = max(self.ppl_cand / self.ppl_ref, self.ppl_ref / self.ppl_cand)
            if ratio > tol.max_ppl_ratio:
                out.append(f"perplexity ratio {ratio:.4g} > {tol.max_ppl_ratio:g}")
        return out


@dataclass
class PromptReport:
    prompt: str
    prompt_tokens: int
    continuation: list[int]
    candidate_continuation: list[int]
    kl: list[float]  # per continuation position
    scores: Scores
    divergence: Divergence
    passed: bool
    reasons: list[str]
    stats: PositionStats = field(repr=False)


@dataclass
class ParityReport:
    model: str
    reference: str  # runtime/backend
    candidate: str
    precision: str
    top_k: int
    tolerance: ParityTolerance
    prompts: list[PromptReport]
    overall: Scores
    passed: bool
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for p in d["prompts"]:
            del p["stats"]
        d["tolerance"] = self.tolerance.model_dump(exclude_none=True)
        return d


# --- running a comparison -----------------------------------------------------------------


async def greedy(engine: Engine, prompt: str, max_tokens: int) -> list[int]:
    """The engine's greedy (temperature 0) continuation of a raw prompt, as token ids."""
    req = GenerationRequest("parity", SamplingParams(temperature=0.0, max_tokens=max_tokens), prompt=prompt)
    out: list[int] = []
    async for ev in engine.generate(req):
        out.extend(ev.token_ids)
    return out


async def compare_prompt(
    reference: Engine, candidate: Engine, prompt: str, tokens: int, top_k: int, tol: ParityTolerance
) -> PromptReport:
    """Compare the engines on one prompt (see the module docstring)."""
    ids = await reference.tokenize(prompt)
    if await candidate.tokenize(prompt) != ids:
        raise VocabularyMismatch(f"the engines tokenize {prompt[:40]!r} differently; they must share a vocabulary")
    cont, cand_cont = await asyncio.gather(greedy(reference, prompt, tokens), greedy(candidate, prompt, tokens))
    seq = ids + cont
    ref_logits, cand_logits = await asyncio.gather(reference.logits(seq), candidate.logits(seq))
    # Row i predicts token i + 1: rows len(ids)-1 .. len(seq)-2 predict the continuation.
    rows = slice(len(ids) - 1, len(seq) - 1)
    stats = compare_logits(ref_logits[rows], cand_logits[rows], cont, top_k)
    div = first_divergence(cont, cand_cont, stats.top_ref, stats.top_cand)
    scores = Scores.of([stats])
    reasons = scores.violations(tol)
    if not div.within_top_k:
        reasons.append(
            f"greedy decodes diverge at position {div.position} (reference {div.ref_token}, "
            f"candidate {div.cand_token}) outside each other's top-{top_k}"
        )
    return PromptReport(
        prompt=prompt, prompt_tokens=len(ids), continuation=cont, candidate_continuation=cand_cont,
        kl=[float(x) for x in stats.kl], scores=scores, divergence=div, passed=not reasons, reasons=reasons,
        stats=stats,
    )


def _label(engine: Engine) -> str:
    return f"{engine.info.runtime}/{engine.info.backend}"


async def compare(
    reference: Engine,
    candidate: Engine,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    *,
    model: str = "",
    tokens: int = DEFAULT_TOKENS,
    top_k: int = DEFAULT_TOP_K,
    tolerance: ParityTolerance | None = None,
) -> ParityReport:
    """Compare two loaded engines on `prompts`.  Raises VocabularyMismatch."""
    precision = precision_class(
        reference.info.extra.get("precision", "unknown"), candidate.info.extra.get("precision", "unknown")
    )
    tol = tolerance or tolerance_for(reference.info.backend, candidate.info.backend, precision)
    reports = [await compare_prompt(reference, candidate, p, tokens, top_k, tol) for p in prompts]
    overall = Scores.of([r.stats for r in reports])
    reasons = [f"prompt {i}: {why}" for i, r in enumerate(reports) for why in r.reasons]
    return ParityReport(
        model=model, reference=_label(reference), candidate=_label(candidate), precision=precision,
        top_k=top_k, tolerance=tol, prompts=reports, overall=overall, passed=not reasons, reasons=reasons,
    )


async def open_engine(
    spec: ModelSpec,
    registry: Registry,
    settings: Settings,
    engine: str,
    runtime: str | None = None,
    model_path: str | None = None,
    host: HostCapabilities | None = None,
) -> Engine:
    """Load `spec` on the first candidate for `engine` ("cpu", "vulkan", ...) and `runtime`.

    The one place parity decides how an engine is built; `model_path` replaces the model's file
    (to compare another quantisation of the same model).  Raises ParityError.
    """
    host = host if host is not None else await asyncio.to_thread(probe_host)
    if not settings.workers:
        host = in_one_process(host)
        os.environ.update(vulkan_visible_env(host.vulkan))  # before the first Vulkan load
    try:
        the_plan = plan(spec, host, Preference(engine, runtime, settings.device), registry.formats(spec))
    except SelectionError as exc:
        raise ParityError(str(exc)) from exc
    cand = the_plan.candidates[0]
    try:
        path = model_path or str(await asyncio.to_thread(registry.resolve, spec, cand.format))
    except ModelUnavailable as exc:
        raise ParityError(str(exc)) from exc
    mmproj = await asyncio.to_thread(registry.projector, spec) if cand.format == "gguf" else None  # its images too
    eng = local_engine(cand, engine_config(spec, cand, path, settings, str(mmproj or "")), settings, host)
    try:
        await eng.load()
    except EngineError as exc:
        raise ParityError(f"cannot load {spec.id} on {cand.runtime}/{cand.backend}: {exc}") from exc
    return eng


async def run_parity(
    spec: ModelSpec,
    registry: Registry,
    settings: Settings,
    *,
    engine: str,
    reference: str = "cpu",
    runtime: str | None = None,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    tokens: int = DEFAULT_TOKENS,
    top_k: int = DEFAULT_TOP_K,
    candidate_path: str | None = None,
    reference_runtime: str | None = None,
) -> ParityReport:
    """Open both engines for `spec`, compare them, close them.  Raises ParityError.

    `runtime` pins the candidate's runtime, `reference_runtime` the reference's (default: the same),
    so llama.cpp can be checked against ONNX Runtime GenAI on the same weights.
    """
    host = await asyncio.to_thread(probe_host)
    ref = await open_engine(spec, registry, settings, reference, reference_runtime or runtime, host=host)
    try:
        cand = await open_engine(spec, registry, settings, engine, runtime, candidate_path, host=host)
        try:
            precision = precision_class(
                ref.info.extra.get("precision", "unknown"), cand.info.extra.get("precision", "unknown")
            )
            keys = (ref.info.backend, cand.info.backend)
            if ref.info.runtime != cand.info.runtime:  # across runtimes the kernels differ everywhere
                keys = (f"{ref.info.runtime}/{ref.info.backend}", f"{cand.info.runtime}/{cand.info.backend}")
            tol = tolerance_for(*keys, precision, spec.parity)
            return await compare(ref, cand, prompts, model=spec.id, tokens=tokens, top_k=top_k, tolerance=tol)
        finally:
            await cand.close()
    finally:
        await ref.close()
