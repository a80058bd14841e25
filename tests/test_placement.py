"""Several GPUs on one host: which GPUs a model may use (models.yaml `devices`) and when one copy
is split across them (`placement`), decided from the plan's candidates and the memory budgets,
and carried out by the pool as llama.cpp's device list and tensor split."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from engines.base import EngineConfig, ModelTooLarge
from engines.llamacpp.runtime import LlamaCppOptions
from gateway.app import create_app
from gateway.host.hardware import CudaDevice, CudaInfo, HostCapabilities
from gateway.host.placement import chosen, split_of
from gateway.host.selection import Candidate
from gateway.models.memory import estimate, gguf_info
from gateway.models.pool import ModelManager
from gateway.models.registry import Registry, load_registry
from gateway.models.routing import WorkerGroup
from gateway.settings import Settings
from tests import hosts
from tests.conftest import MODEL, NO_CHECKS, ServerThread
from tests.fakes import FakeEngine

MiB = 1 << 20
A, B, C = (Candidate("llamacpp", "cuda", f"NVIDIA H100 #{i}", f"CUDA{i}", "gguf", i) for i in range(3))
CPU = Candidate("llamacpp", "cpu", "cpu", "", "gguf")
KEYS = {A: "cuda:0", B: "cuda:1", C: "cuda:2"}


@pytest.mark.parametrize(("devices", "allowed"), [
    (None, [A, B, C, CPU]), ("all", [A, B, C, CPU]), ([1], [B, CPU]), ([0, 2], [A, C, CPU]), (["1"], [B, CPU]),
    (["#2"], [C, CPU]), (["h100"], [A, B, C, CPU]), (["rtx"], [CPU]),
])
def test_devices_keep_the_gpus_named_and_the_cpu(devices: object, allowed: list[Candidate]) -> None:
    assert [c for c in (A, B, C, CPU) if chosen(c, devices)] == allowed  # type: ignore[arg-type]


@pytest.mark.parametrize(("budgets", "devices", "keys", "shares"), [
    ({"cuda:0": 80, "cuda:1": 80, "cuda:2": 80}, None, ("cuda:0", "cuda:1", "cuda:2"), (0.3333, 0.3333, 0.3333)),
    ({"cuda:0": 60, "cuda:1": 20, "cuda:2": 20}, [0, 1], ("cuda:0", "cuda:1"), (0.75, 0.25)),
    ({"cuda:0": 80, "cuda:1": 80, "cuda:2": 80}, [0], None, None),  # one GPU: no split
    ({"cuda:0": 80, "cuda:1": 0, "cuda:2": 80}, None, None, None),  # a GPU of unknown memory: no split
])
def test_a_split_takes_the_other_gpus_of_its_engine_by_budget(budgets: dict[str, int], devices: object,
                                                               keys: tuple[str, ...] | None,
                                                               shares: tuple[float, ...] | None) -> None:
    s = split_of(A, (A, B, C, CPU), devices, budgets, KEYS)  # type: ignore[arg-type]
    assert (s.keys if s else None, s.shares if s else None) == (keys, shares)
    if s is not None:
        assert s.members[0] == A and s.key == "+".join(keys or ()) and s.room(budgets) == sum(budgets[k] for k in s.keys)
    # Another engine or build is never a mate.
    vulkan = Candidate("llamacpp", "vulkan", "NVIDIA H100 #1", "Vulkan1", "gguf", 1)
    assert split_of(A, (A, vulkan), None, {"cuda:0": 80, "vulkan:1": 80}, {A: "cuda:0", vulkan: "vulkan:1"}) is None


TWO_H100 = hosts.host(cuda=CudaInfo(devices=tuple(CudaDevice(i, "NVIDIA H100 80GB HBM3", 80 << 30, "9.0")
                                                  for i in range(2)), driver_version="580", cuda_version="13.0"),
                      llamacpp=hosts.llama("CUDA", cuda=2))


def _registry(tmp_path: Path, extra: str) -> Registry:
    gguf = load_registry(Path(__file__).resolve().parent.parent / "models.yaml")
    path = gguf.resolve(gguf.models[MODEL], "gguf")
    cfg = tmp_path / "models.yaml"
    cfg.write_text(f"models:\n  - id: m\n    formats: {{gguf: {{path: {path}}}}}\n{extra}")
    return load_registry(cfg, cache_dir=tmp_path / "cache")


def _load(tmp_path: Path, extra: str, gpu_budget: int, host: HostCapabilities | None = None, device: str | None = None
          ) -> tuple[EngineConfig, dict[str, int]]:
    """Load model "m" on a two-GPU host; the last engine's config, and the bytes each GPU holds."""
    made: list[EngineConfig] = []

    def factory(runtime: str, config: EngineConfig) -> FakeEngine:
        made.append(config)
        return FakeEngine(config)

    reg = _registry(tmp_path, extra)
    settings = Settings.from_env(env=NO_CHECKS, gpu_memory_budget=gpu_budget, parallel=1, prefix_cache=0,
                                 engine="cuda", device=device)
    manager = ModelManager(reg, settings, factory, host=host or TWO_H100)  # type: ignore[arg-type]

    async def go() -> dict[str, int]:
        entry = await manager.get(reg.models["m"])
        used = {d: s["used_bytes"] for d, s in manager.memory_status().items() if d != "cpu"}
        members = entry.engine.members if isinstance(entry.engine, WorkerGroup) else [entry.engine]
        assert [m.config.device_key for m in members] == [c.device_key for c in made[-len(members):]]  # type: ignore[attr-defined]
        await manager.close()
        return used

    used = asyncio.run(go())
    return made[-1], used


def _gpu_need(tmp_path: Path) -> int:
    reg = _registry(tmp_path, "")
    info = gguf_info(reg.resolve(reg.models["m"], "gguf"))
    assert info is not None
    return estimate(info, 2048, 1, "cuda:0").gpu


def test_a_model_too_large_for_one_gpu_is_split_over_both(tmp_path: Path) -> None:
    need = _gpu_need(tmp_path)
    budget = int(need * 0.7)  # one GPU holds 70 % of it, two hold 140 %
    config, used = _load(tmp_path, "", budget)
    lo = LlamaCppOptions.of(config)
    assert (config.device_key, lo.split_devices, lo.tensor_split) == ("CUDA0", ("CUDA1",), (0.5, 0.5))
    # Each GPU's budget holds its half.
    assert used["cuda:0"] == used["cuda:1"] == need // 2 and used["cuda:0"] <= budget


def test_auto_puts_a_replica_on_each_identical_gpu(tmp_path: Path) -> None:
    need = _gpu_need(tmp_path)
    config, used = _load(tmp_path, "", 40 << 30)
    # The second copy's engine, on the second GPU; each GPU holds a whole copy.
    assert (config.device_key, LlamaCppOptions.of(config).split_devices) == ("CUDA1", ())
    assert used["cuda:0"] == used["cuda:1"] == need


def test_replicas_of_different_gpus_only_when_asked(tmp_path: Path) -> None:
    mixed = hosts.host(cuda=CudaInfo(devices=(CudaDevice(0, "NVIDIA H100 80GB HBM3", 80 << 30, "9.0"),
                                              CudaDevice(1, "NVIDIA L4", 24 << 30, "8.9"))),
                       llamacpp=hosts.llama("CUDA", cuda=2))
    config, used = _load(tmp_path, "", 20 << 30, mixed)
    assert config.device_key == "CUDA0" and used["cuda:1"] == 0 < used["cuda:0"]
    config, used = _load(tmp_path, "    placement: replicas\n", 20 << 30, mixed)
    assert config.device_key == "CUDA1" and used["cuda:0"] == used["cuda:1"] > 0
    config, used = _load(tmp_path, "    placement: replicas\n    devices: [1]\n", 20 << 30, mixed)
    assert config.device_key == "CUDA1" and used["cuda:0"] == 0 < used["cuda:1"]


def test_placement_split_splits_a_small_model_and_devices_choose_the_gpus(tmp_path: Path) -> None:
    config, used = _load(tmp_path, "    placement: split\n", 40 << 30)
    assert LlamaCppOptions.of(config).split_devices == ("CUDA1",) and used["cuda:0"] == used["cuda:1"] > 0
    only = _load(tmp_path, "    placement: split\n    devices: [1]\n", 40 << 30)[0]
    assert (only.device_key, LlamaCppOptions.of(only).split_devices) == ("CUDA1", ())


def test_a_model_too_large_for_both_gpus_says_so(tmp_path: Path) -> None:
    need = _gpu_need(tmp_path)
    with pytest.raises(ModelTooLarge, match=r"cuda:0\+cuda:1"):
        _load(tmp_path, "    devices: all\n", int(need * 0.4))


def _served(tmp_path: Path, extra: str) -> ServerThread:
    """A started gateway serving model "m" (models.yaml `extra`) with test engines on the two-H100 host."""
    settings = Settings.from_env(env=NO_CHECKS, config=str(tmp_path / "models.yaml"), parallel=1, prefix_cache=0,
                                 engine="cuda")
    app = create_app(settings, _registry(tmp_path, extra),
                     engine_factory=lambda runtime, config: FakeEngine(config),  # type: ignore[arg-type]
                     host=TWO_H100)
    return ServerThread(app).start()


def test_health_shows_the_split_and_each_gpus_part(tmp_path: Path) -> None:
    server = _served(tmp_path, "    placement: split\n")
    try:
        row = httpx.get(f"{server.url}/health", timeout=30).json()["models"]["m"]
        page_row = next(m for m in httpx.get(f"{server.url}/api/status", timeout=30).json()["models"] if m["id"] == "m")
        devices = httpx.get(f"{server.url}/api/devices", timeout=60).json()
    finally:
        server.stop()
    # `gateway devices` (its text and JSON, as the page shows them) says the placement before a load.
    assert devices["plans"]["m"]["placement"] == "split over cuda:0 (0.5), cuda:1 (0.5)"
    assert "  placement: split over cuda:0 (0.5), cuda:1 (0.5)" in devices["text"]
    assert row["split"] == {"cuda:0": 0.5, "cuda:1": 0.5}
    assert page_row["placement"] == "split over cuda:0 (0.5), cuda:1 (0.5)"
    held = row["memory"]["held_bytes"]
    assert held["cuda:0"] == held["cuda:1"] > 0 and row["memory"]["estimate"]["device"] == "cuda:0+cuda:1"


def test_replicas_serve_as_one_model_and_health_lists_them(tmp_path: Path) -> None:
    server = _served(tmp_path, "    placement: replicas\n")
    try:
        answers = [httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
            "model": "m", "messages": [{"role": "user", "content": f"conversation {i}"}]}) for i in range(4)]
        row = httpx.get(f"{server.url}/health", timeout=30).json()["models"]["m"]
        page_row = next(m for m in httpx.get(f"{server.url}/api/status", timeout=30).json()["models"] if m["id"] == "m")
        devices = httpx.get(f"{server.url}/api/devices", timeout=60).json()
    finally:
        server.stop()
    assert page_row["placement"] == devices["plans"]["m"]["placement"] == "replicas on cuda:0, cuda:1"
    assert all(a.status_code == 200 for a in answers)
    assert row["replicas"] == ["cuda:0", "cuda:1"] and "split" not in row
    workers = row["worker"]["workers"]
    assert len(workers) == 2 and sum(w["routed"] for w in workers) >= 4


@pytest.mark.parametrize(("device", "keys"), [("all", ("cuda:0", "cuda:1")), ("0,1", ("cuda:0", "cuda:1")),
                                              ("1", ("cuda:1",)), (None, ("cuda:0",))])
def test_the_device_setting_names_one_gpu_or_several(tmp_path: Path, device: str | None, keys: tuple[str, ...]) -> None:
    """`--device all` / `0,1` are the GPUs every model may use (over models.yaml's `devices: [0]`);
    `--device 1` is the one GPU to serve on, as before."""
    _, used = _load(tmp_path, "    devices: [0]\n", 40 << 30, device=device)
    assert tuple(d for d, b in sorted(used.items()) if b) == keys
