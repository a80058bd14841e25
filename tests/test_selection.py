"""The selector is pure: one row per kind of host, and the plan it must produce."""

from __future__ import annotations

import pytest

from engines.executorch import ExecuTorchFound
from gateway.host.hardware import CudaInfo, HostCapabilities, PlatformRuntime
from gateway.host.selection import Preference, SelectionError, plan
from gateway.models.registry import ModelSpec
from tests import hosts

GGUF = ModelSpec.model_validate({"id": "m", "formats": {"gguf": {"path": "m.gguf"}}})
ALL = ModelSpec.model_validate({"id": "m", "formats": {
    "gguf": {"path": "m.gguf"}, "onnx": {"path": "m-onnx"}, "coreml": {"path": "m.mlpackage"}}})


def labels(h: HostCapabilities, spec: ModelSpec = GGUF, **pref: str) -> list[str]:
    return [f"{c.label}:{c.device_key or c.device}" for c in plan(spec, h, Preference(**pref)).candidates]


@pytest.mark.parametrize(("name", "h", "spec", "pref", "expected"), [
    ("cpu only", hosts.CPU_ONLY, GGUF, {}, ["llamacpp/cpu:cpu"]),
    # lavapipe is slower than the CPU engine: auto leaves it out, --engine vulkan takes it.
    ("lavapipe auto", hosts.LAVAPIPE, GGUF, {}, ["llamacpp/cpu:cpu"]),
    ("lavapipe explicit", hosts.LAVAPIPE, GGUF, {"engine": "vulkan"}, ["llamacpp/vulkan:Vulkan0"]),
    ("nvidia + vulkan", hosts.NVIDIA, GGUF, {}, ["llamacpp/cuda:CUDA0", "llamacpp/vulkan:Vulkan0", "llamacpp/cpu:cpu"]),
    ("nvidia, vulkan asked", hosts.NVIDIA, GGUF, {"engine": "vulkan"}, ["llamacpp/vulkan:Vulkan0"]),
    ("h100 host, vulkan icd broken", hosts.H100_HOST, GGUF, {}, ["llamacpp/cuda:CUDA0", "llamacpp/cpu:cpu"]),
    ("amd vulkan only", hosts.AMD_VULKAN, GGUF, {}, ["llamacpp/vulkan:Vulkan0", "llamacpp/cpu:cpu"]),
    # Discrete before integrated; the build has no CUDA, so the NVIDIA card runs Vulkan.
    ("igpu + dgpu", hosts.IGPU_DGPU, GGUF, {}, ["llamacpp/vulkan:Vulkan1", "llamacpp/vulkan:Vulkan0", "llamacpp/cpu:cpu"]),
    ("igpu + dgpu, device by name", hosts.IGPU_DGPU, GGUF, {"engine": "vulkan", "device": "intel"}, ["llamacpp/vulkan:Vulkan0"]),
    ("igpu + dgpu, device by index", hosts.IGPU_DGPU, GGUF, {"engine": "vulkan", "device": "1"}, ["llamacpp/vulkan:Vulkan1"]),
    ("apple", hosts.APPLE, ALL, {}, ["llamacpp/metal:MTL0", "coreml/coreml:ALL", "llamacpp/cpu:cpu"]),
    ("apple coreml", hosts.APPLE, ALL, {"engine": "coreml"}, ["coreml/coreml:ALL"]),
    ("windows directml", hosts.WINDOWS_DML, ALL, {}, ["ortgenai/directml:0", "llamacpp/cpu:cpu", "ortgenai/cpu:cpu"]),
    ("windows, runtime pinned", hosts.WINDOWS_DML, ALL, {"engine": "cpu", "runtime": "ortgenai"}, ["ortgenai/cpu:cpu"]),
])
def test_plan_per_host(name: str, h: HostCapabilities, spec: ModelSpec, pref: dict[str, str], expected: list[str]) -> None:
    assert labels(h, spec, **pref) == expected, name


def test_model_preference_list_orders_auto() -> None:
    spec = ModelSpec.model_validate({"id": "m", "formats": {"gguf": {"path": "m"}}, "engines": ["vulkan", "cpu"]})
    assert labels(hosts.NVIDIA, spec) == ["llamacpp/vulkan:Vulkan0", "llamacpp/cpu:cpu"]


def test_explicit_engine_never_falls_to_cpu_and_says_what_is_missing() -> None:
    with pytest.raises(SelectionError) as e:
        plan(GGUF, hosts.CPU_ONLY, Preference("vulkan"))
    assert "llamacpp/vulkan" in str(e.value) and "Vulkan loader" in str(e.value)
    with pytest.raises(SelectionError) as e:
        plan(GGUF, hosts.NVIDIA, Preference("metal"))
    assert "Metal needs macOS" in str(e.value)


def test_build_without_backend_names_the_install_command() -> None:
    h = hosts.host(vulkan=hosts.AMD_VULKAN.vulkan)  # GPU present, CPU-only build
    with pytest.raises(SelectionError, match="built without Vulkan.*install-llama-cpp.sh vulkan"):
        plan(GGUF, h, Preference("vulkan"))
    # auto still serves, on the CPU, and the skipped GPU counts as a fallback to report.
    p = plan(GGUF, h)
    assert [c.label for c in p.candidates] == ["llamacpp/cpu"]
    assert any("built without Vulkan" in s.why for s in p.unusable())


def test_h100_vulkan_reason_is_the_driver_failure() -> None:
    with pytest.raises(SelectionError, match="Vulkan driver present but failed to initialise: libGLX_nvidia.so.0: "
                       "vk_icdNegotiateLoaderICDInterfaceVersion returned VK_ERROR_INITIALIZATION_FAILED"):
        plan(GGUF, hosts.H100_HOST, Preference("vulkan"))
    assert any("failed to initialise" in s.why for s in plan(GGUF, hosts.H100_HOST).unusable())


def test_hidden_cuda_devices_fall_back_with_the_reason() -> None:
    h = hosts.host(cuda=CudaInfo(error="no CUDA device visible (CUDA_VISIBLE_DEVICES='')", visible_devices="",
                                 driver_version="580.1"), llamacpp=hosts.llama("CUDA"))
    p = plan(GGUF, h)
    assert [c.label for c in p.candidates] == ["llamacpp/cpu"]
    assert [s.why for s in p.unusable()] == ["no CUDA device visible (CUDA_VISIBLE_DEVICES='')"]


def test_missing_format_and_unknown_names() -> None:
    with pytest.raises(SelectionError, match="no onnx format.*gateway convert"):
        plan(GGUF, hosts.WINDOWS_DML, Preference("directml"))
    with pytest.raises(SelectionError, match="unknown engine"):
        plan(GGUF, hosts.CPU_ONLY, Preference("tpu"))
    with pytest.raises(SelectionError, match="no vulkan|not the requested device"):
        plan(GGUF, hosts.LAVAPIPE, Preference("vulkan", device="7"))


def test_only_engines_preferred_to_the_chosen_one_count_as_fallback() -> None:
    p = plan(GGUF, hosts.H100_HOST)
    cuda, cpu = p.candidates
    assert p.unusable(before=cuda) == []  # serving on CUDA is no fallback from a broken Vulkan
    assert [s.what for s in p.unusable(before=cpu)] == ["llamacpp/vulkan"]


ET = PlatformRuntime(True, "", "ExecuTorch runtime (XNNPACK)")
ET_VK = PlatformRuntime(True, "", "ExecuTorch Vulkan backend")
BOTH_PTE = ["gguf", "pte", "pte:xnnpack", "pte:vulkan"]


def test_executorch_vulkan_takes_the_vulkan_program_on_each_gpu() -> None:
    h = hosts.IGPU_DGPU.with_found("executorch", ExecuTorchFound(ET, ET_VK))
    p = plan(GGUF, h, Preference("vulkan"), BOTH_PTE)
    assert [f"{c.label}:{c.device_key}:{c.format}" for c in p.candidates] == [
        "llamacpp/vulkan:Vulkan1:gguf", "llamacpp/vulkan:Vulkan0:gguf",
        "executorch/vulkan:1:pte:vulkan", "executorch/vulkan:0:pte:vulkan"]
    cpu = plan(GGUF, h, Preference("cpu", runtime="executorch"), BOTH_PTE).candidates
    assert [(c.label, c.format) for c in cpu] == [("executorch/cpu", "pte:xnnpack")]
    by_name = plan(GGUF, h, Preference("vulkan", runtime="executorch", device="intel"), BOTH_PTE).candidates
    assert [c.device_key for c in by_name] == ["0"]


def test_executorch_vulkan_says_what_is_missing() -> None:
    h = hosts.AMD_VULKAN.with_found("executorch", ExecuTorchFound(ET, ET_VK))
    # Only the XNNPACK program: the Vulkan engine names the conversion; the CPU engine serves.
    with pytest.raises(SelectionError, match=r"no pte:vulkan format .*--to executorch --delegate vulkan"):
        plan(GGUF, h, Preference("vulkan", runtime="executorch"), ["gguf", "pte", "pte:xnnpack"])
    assert [c.label for c in plan(GGUF, h, Preference("cpu", runtime="executorch"),
                                  ["gguf", "pte", "pte:xnnpack"]).candidates] == ["executorch/cpu"]
    unbuilt = h.with_found("executorch", ExecuTorchFound(ET, PlatformRuntime(False, "none is built: scripts/install-executorch.sh vulkan")))
    with pytest.raises(SelectionError, match="install-executorch.sh vulkan"):
        plan(GGUF, unbuilt, Preference("vulkan", runtime="executorch"), BOTH_PTE)
    with pytest.raises(SelectionError, match="no Vulkan loader"):
        plan(GGUF, hosts.CPU_ONLY.with_found("executorch", ExecuTorchFound(ET, ET_VK)),
             Preference("vulkan", runtime="executorch"), BOTH_PTE)
    # lavapipe: a software device only when asked for, as with llama.cpp.
    lvp = hosts.LAVAPIPE.with_found("executorch", ExecuTorchFound(ET, ET_VK))
    assert "executorch/vulkan" not in [c.label for c in plan(GGUF, lvp, Preference(), BOTH_PTE).candidates]
    assert [c.label for c in plan(GGUF, lvp, Preference("vulkan", runtime="executorch"), BOTH_PTE).candidates] == [
        "executorch/vulkan"]
