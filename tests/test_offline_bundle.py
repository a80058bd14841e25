"""scripts/offline-bundle.sh without the registry: a lock with nothing pinned, no llama.cpp source,
a GGUF file and a model from the Hugging Face Hub cache. The parts join back to the tar that
SHA256SUMS names, the manifest inside covers the model, and install.sh --check unpacks and checks
the bundle and refuses a damaged part."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _bundle(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Path:
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("the bundle holds the repository's HEAD: needs a git checkout")
    lock = tmp_path / "nothing.txt"
    lock.write_text("# nothing pinned: no wheels to download\n")
    out = tmp_path / "out"
    subprocess.run(["bash", str(ROOT / "scripts/offline-bundle.sh"), "--out", str(out), "--requirements", str(lock),
                    "--no-llama-src", *args], check=True, cwd=tmp_path, timeout=120,
                   env={**os.environ, "PYTHON": sys.executable, **(env or {})})
    return out


def _members(out: Path) -> dict[str, bytes]:
    """The bundle's files by path, read from the parts joined in order, after checking the join
    against SHA256SUMS."""
    parts = sorted(out.glob("llm-gateway.tar.part-*"))
    sums = dict(reversed(line.split("  ", 1)) for line in (out / "SHA256SUMS").read_text().splitlines())
    joined = b"".join(p.read_bytes() for p in parts)
    assert _sha256(joined) == sums["llm-gateway.tar"]
    assert all(_sha256(p.read_bytes()) == sums[p.name] for p in parts)
    (out.parent / "joined.tar").write_bytes(joined)
    with tarfile.open(out.parent / "joined.tar") as tar:
        return {m.name.removeprefix("./"): tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_parts_join_to_the_manifest_and_install_checks_them(tmp_path: Path) -> None:
    model = os.urandom(300_000)
    (tmp_path / "tiny.gguf").write_bytes(model)
    out = _bundle(tmp_path, "--part-size", "100K", "--model", "tiny-model=tiny.gguf")
    assert len(list(out.glob("llm-gateway.tar.part-*"))) >= 3
    files = _members(out)
    manifest = dict(reversed(line.split("  ", 1)) for line in files["manifest.sha256"].decode().splitlines())
    assert manifest["./models/tiny.gguf"] == _sha256(model)
    assert files["models/gguf.list"].decode().split() == ["tiny-model", "tiny.gguf"]
    assert all(_sha256(files[name.removeprefix("./")]) == digest for name, digest in manifest.items())
    assert "BUNDLE_PYTHON=3.12" in files["bundle.env"].decode() and "src/llm-gateway.tar.gz" in files
    assert (out / "install.sh").read_text() == (ROOT / "scripts/offline-install.sh").read_text()

    check = ["bash", str(out / "install.sh"), "--check", "--dir", str(tmp_path / "gw")]
    subprocess.run(check, check=True, capture_output=True, timeout=60)
    assert (tmp_path / "gw/offline-bundle/models/tiny.gguf").read_bytes() == model
    damaged = sorted(out.glob("llm-gateway.tar.part-*"))[1]
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"?")
    r = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "FAILED" in r.stdout + r.stderr


def test_a_hub_model_travels_in_the_hub_cache_layout(tmp_path: Path) -> None:
    """qwen2.5-0.5b-instruct (models.yaml, from the Hub) out of a Hub cache with one snapshot, offline."""
    hub = tmp_path / "hub"
    repo = hub / "models--Qwen--Qwen2.5-0.5B-Instruct-GGUF"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    weights = os.urandom(50_000)
    (snapshot / "qwen2.5-0.5b-instruct-q4_k_m.gguf").write_bytes(weights)
    out = _bundle(tmp_path, "--model", "qwen2.5-0.5b-instruct",
                  env={"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"})
    files = _members(out)
    rel = f"hf/models--Qwen--Qwen2.5-0.5B-Instruct-GGUF/snapshots/{COMMIT}/qwen2.5-0.5b-instruct-q4_k_m.gguf"
    assert files[rel] == weights
    assert files["hf/models--Qwen--Qwen2.5-0.5B-Instruct-GGUF/refs/main"].decode() == COMMIT
