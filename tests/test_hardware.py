"""The host probe on this machine, and its honesty when a driver is present but broken."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engines.llamacpp.runtime import found as llamacpp_found
from gateway.host.hardware import probe_cuda, probe_host, probe_vulkan, run_child

ROOT = Path(__file__).resolve().parent.parent
HAVE_LOADER = Path("/usr/lib/x86_64-linux-gnu/libvulkan.so.1").exists() or bool(shutil.which("vulkaninfo"))
needs_loader = pytest.mark.skipif(
    not HAVE_LOADER and not os.environ.get("CI"),
    reason="no Vulkan loader here (scripts/test.sh installs libvulkan1 and mesa-vulkan-drivers)",
)

# A Vulkan driver that refuses to initialise, like the NVIDIA ICD on an H100 host without libglvnd.
BROKEN_ICD = r"""
#include <stdint.h>
int32_t vk_icdNegotiateLoaderICDInterfaceVersion(uint32_t *v) { (void)v; return -3; }
void *vk_icdGetInstanceProcAddr(void *i, const char *n) { (void)i; (void)n; return 0; }
"""


@pytest.fixture(scope="module")
def broken_icd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("icd")
    (d / "broken.c").write_text(BROKEN_ICD)
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed to build the stand-in driver"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "libbroken_icd.so"), str(d / "broken.c")], check=True)
    manifest = d / "broken_icd.json"
    manifest.write_text(json.dumps({"file_format_version": "1.0.0",
                                    "ICD": {"library_path": str(d / "libbroken_icd.so"), "api_version": "1.3.0"}}))
    return manifest


@needs_loader
def test_probe_lists_lavapipe_with_the_seed_fields() -> None:
    vk = probe_vulkan()
    assert vk.loader, vk.error
    lvp = [d for d in vk.devices if d.driver_name == "llvmpipe" or "llvmpipe" in d.name]
    assert lvp, f"lavapipe not listed: {vk}"
    d = lvp[0]
    assert d.type == "cpu"
    assert d.api_version.startswith("1.")
    assert d.vendor_id == 0x10005 and d.driver_info.startswith("Mesa")
    assert d.device_local_bytes > 0
    assert all(n >= 64 for n in d.max_compute_workgroup_size)
    assert d.max_compute_shared_memory_bytes >= 16384 and d.max_compute_workgroup_invocations >= 128


@needs_loader
def test_broken_driver_is_reported_as_failing_to_initialise(broken_icd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VK_DRIVER_FILES", str(broken_icd))
    vk = probe_vulkan()
    assert vk.devices == ()
    assert vk.reason.startswith("Vulkan driver present but failed to initialise: ")
    assert "vk_icdNegotiateLoaderICDInterfaceVersion returned VK_ERROR_INITIALIZATION_FAILED (-3)" in vk.reason


def test_missing_driver_library_is_a_reported_absence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = tmp_path / "gone.json"
    manifest.write_text(json.dumps({"ICD": {"library_path": str(tmp_path / "libgone.so")}}))
    monkeypatch.setenv("VK_DRIVER_FILES", str(manifest))
    vk = probe_vulkan()
    assert vk.devices == ()
    assert "which does not exist" in vk.reason and "fix: reinstall the driver package" in vk.reason


def _cc() -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed to build the stand-in drivers"
    return cc


def _manifest(path: Path, library: str, api: str = "1.3.0") -> Path:
    path.write_text(json.dumps({"file_format_version": "1.0.0", "ICD": {"library_path": library, "api_version": api}}))
    return path


def test_a_driver_with_an_unresolved_dependency_names_the_missing_library(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stand-in driver links against a library that is then removed, as when a package is missing.
    (tmp_path / "dep.c").write_text("int standin_dep(void) { return 1; }\n")
    subprocess.run([_cc(), "-shared", "-fPIC", "-Wl,-soname,libstandin_dep.so.1", "-o",
                    str(tmp_path / "libstandin_dep.so.1"), str(tmp_path / "dep.c")], check=True)
    (tmp_path / "icd.c").write_text("int standin_dep(void);\nint icd_uses_dep(void) { return standin_dep(); }\n"
                                    + BROKEN_ICD)
    subprocess.run([_cc(), "-shared", "-fPIC", "-o", str(tmp_path / "libneeds_dep_icd.so"), str(tmp_path / "icd.c"),
                    str(tmp_path / "libstandin_dep.so.1")], check=True)
    (tmp_path / "libstandin_dep.so.1").unlink()
    monkeypatch.setenv("VK_DRIVER_FILES", str(_manifest(tmp_path / "m.json", str(tmp_path / "libneeds_dep_icd.so"))))
    reason = probe_vulkan().reason
    assert "libstandin_dep.so.1: cannot open shared object file" in reason
    assert "fix: install the package that provides libstandin_dep.so.1" in reason


def test_a_driver_older_than_vulkan_1_2_is_named(broken_icd: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    library = json.loads(broken_icd.read_text())["ICD"]["library_path"]
    monkeypatch.setenv("VK_DRIVER_FILES", str(_manifest(tmp_path / "old.json", library, api="1.1.130")))
    reason = probe_vulkan().reason
    assert "supports Vulkan 1.1; llama.cpp needs 1.2 or newer" in reason and "fix: update the GPU driver" in reason


def test_nvidia_driver_without_libglvnd_or_device_nodes_gets_the_remedy(tmp_path: Path) -> None:
    from gateway.host.vulkan_probe import runtime_problems, soname_remedy

    (tmp_path / "nvidiactl").touch()
    problems = runtime_problems("/usr/lib/x86_64-linux-gnu/libGLX_nvidia.so.0",
                                loadable=lambda so: so != "libGLdispatch.so.0", dev_root=str(tmp_path))
    assert problems == [
        ("it needs libGLdispatch.so.0, which cannot be loaded", "install libglvnd0 (Debian/Ubuntu), which provides libGLdispatch.so.0"),
        (f"{tmp_path}/nvidia0 missing", "give this container or VM the GPU's device nodes (docker --gpus all, or --device)"),
    ]
    (tmp_path / "nvidia0").touch()
    assert runtime_problems("libGLX_nvidia.so.0", loadable=lambda so: True, dev_root=str(tmp_path)) == []
    assert runtime_problems("libvulkan_lvp.so", loadable=lambda so: False, dev_root=str(tmp_path)) == []
    assert soname_remedy("libEGL.so.1") == "install libegl1 (Debian/Ubuntu), which provides libEGL.so.1"


def test_a_driver_returning_no_vkcreateinstance_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Negotiates fine, then has nothing to offer: what the H100's ICD did without libglvnd.
    (tmp_path / "icd.c").write_text(
        "#include <stdint.h>\nint32_t vk_icdNegotiateLoaderICDInterfaceVersion(uint32_t *v) { *v = 5; return 0; }\n"
        "void *vk_icdGetInstanceProcAddr(void *i, const char *n) { (void)i; (void)n; return 0; }\n")
    subprocess.run([_cc(), "-shared", "-fPIC", "-o", str(tmp_path / "libempty_icd.so"), str(tmp_path / "icd.c")],
                   check=True)
    monkeypatch.setenv("VK_DRIVER_FILES", str(_manifest(tmp_path / "m.json", str(tmp_path / "libempty_icd.so"))))
    assert "the driver returns no vkCreateInstance" in probe_vulkan().reason


def test_crashing_probe_is_reported_not_fatal() -> None:
    r = run_child("tests.crash_probe")
    assert "crashed (SIGSEGV)" in r["error"]


def test_cuda_probe_without_driver_reports_why() -> None:
    cuda = probe_cuda()
    if cuda.devices:
        pytest.skip("this host has a CUDA GPU")
    assert cuda.error and ("NVIDIA" in cuda.error or "CUDA" in cuda.error)


def test_host_probe_knows_the_installed_llama_build() -> None:
    h = probe_host()
    build = llamacpp_found(h).package
    assert build.installed and build.has("CPU")
    assert h.cpu.logical_cores >= 1 and h.cpu.memory_bytes > 0
    assert any(name == "CPU" for name, _, _ in build.devices)


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


def test_devices_command_json_and_table() -> None:
    r = _cli("devices", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"host", "ep_matrix", "plans"} <= set(out)
    plan = out["plans"]["smollm2-135m-instruct"]
    assert plan["candidates"][0]["engine"] == "cpu"
    assert any(row["provider"] == "DmlExecutionProvider" and row["os"] == "Windows" for row in out["ep_matrix"])
    table = _cli("devices").stdout
    assert "Vulkan" in table and "EXECUTION PROVIDER" in table and "Plan for smollm2-135m-instruct" in table


@needs_loader
def test_serve_engine_vulkan_with_a_broken_driver_fails_fast_with_the_reason(broken_icd: Path) -> None:
    r = _cli("serve", "--engine", "vulkan", "--port", "0", env={"VK_DRIVER_FILES": str(broken_icd)}, timeout=60)
    assert r.returncode == 2
    assert "--engine vulkan cannot serve" in r.stderr
    assert "Vulkan driver present but failed to initialise" in r.stderr


def test_serve_engine_cuda_without_gpu_fails_fast() -> None:
    if probe_cuda().devices:
        pytest.skip("this host has a CUDA GPU")
    r = _cli("serve", "--engine", "cuda", "--port", "0", timeout=60)
    assert r.returncode == 2 and "--engine cuda cannot serve" in r.stderr and "NVIDIA" in r.stderr
