"""`gateway convert`: a model's GGUF -> Hugging Face checkpoint -> ORT GenAI or CoreML artifact.

Artifacts go into the model cache at `<cache>/converted/<id>/<format>-<precision>[-<provider>]`
(`Registry.converted_dir`), written under a temporary name and renamed when complete, then
marked finished by `gateway-artifact.json`; `Registry.resolve(spec, "onnx")` finds them.  The
intermediate Hugging Face checkpoint (fp32, dequantised from the GGUF) is cached beside them and
reused.  Needs the `convert` extra (torch, transformers, gguf, onnx, onnx-ir, coremltools).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from gateway.registry import ModelSpec, Registry

log = logging.getLogger(__name__)

TARGETS = ("onnx", "coreml")
PRECISIONS = ("fp32", "fp16", "int4")
ONNX_PROVIDERS = ("cpu", "cuda", "dml")
MANIFEST = "gateway-artifact.json"
# What each step imports, so a missing piece is reported before minutes of work.
_NEEDS = {
    "hf": ("torch", "transformers", "gguf", "accelerate"),
    "onnx": ("onnx", "onnx_ir", "onnxruntime_genai"),
    "coreml": ("coremltools",),
}

Progress = Callable[[str], None]


class ConversionError(RuntimeError):
    """A conversion step failed or cannot run here; the message says why."""


def missing_modules(target: str) -> list[str]:
    """Python modules the conversion to `target` needs that are not installed."""
    return [m for m in (*_NEEDS["hf"], *_NEEDS[target]) if importlib.util.find_spec(m) is None]


def convert(
    registry: Registry,
    spec: ModelSpec,
    to: str,
    precision: str = "fp32",
    provider: str = "cpu",
    progress: Progress = log.info,
    force: bool = False,
) -> Path:
    """Produce (or find) the `to` artifact of `spec`; returns its folder.  Blocking, minutes."""
    if to not in TARGETS:
        raise ConversionError(f"unknown target {to!r}; one of {', '.join(TARGETS)}")
    if precision not in PRECISIONS:
        raise ConversionError(f"unknown precision {precision!r}; one of {', '.join(PRECISIONS)}")
    if to == "onnx" and provider not in ONNX_PROVIDERS:
        raise ConversionError(f"unknown provider {provider!r}; one of {', '.join(ONNX_PROVIDERS)}")
    if to == "coreml" and precision == "fp32":
        precision = "fp16"  # CoreML ML programs compute in fp16 on the GPU and Neural Engine
        progress("CoreML: using fp16 (ML programs run fp16 on the GPU / Neural Engine)")
    missing = missing_modules(to)
    if missing:
        raise ConversionError(
            f"converting to {to} needs {', '.join(missing)}: pip install -e '.[convert]'"
        )
    out = registry.converted_dir(spec, to, precision, provider if to == "onnx" else None)
    if (out / MANIFEST).is_file() and not force:
        progress(f"{spec.id}: {out.name} already converted: {out}")
        return out
    t0 = time.perf_counter()
    hf = hf_checkpoint(registry, spec, progress)
    with _staging(out) as tmp:
        if to == "onnx":
            progress(f"[2/2] Hugging Face -> ORT GenAI ({precision}, provider {provider}) ...")
            hf_to_onnx(hf, tmp, precision, provider)
        else:
            progress(f"[2/2] Hugging Face -> CoreML ML program ({precision}, stateful KV cache) ...")
            from gateway.coreml_export import hf_to_coreml

            hf_to_coreml(hf, tmp, precision, context_length=spec.context_length)
    _write_manifest(out, spec, to, precision, provider if to == "onnx" else None, hf)
    progress(f"{spec.id}: wrote {out} in {time.perf_counter() - t0:.0f}s")
    return out


def hf_checkpoint(registry: Registry, spec: ModelSpec, progress: Progress = log.info) -> Path:
    """The model as a Hugging Face fp32 checkpoint, dequantised from its GGUF once and cached."""
    out = registry.converted_dir(spec, "hf", "fp32")
    if (out / MANIFEST).is_file():
        progress(f"[1/2] Hugging Face checkpoint cached: {out}")
        return out
    if "gguf" not in spec.formats:
        raise ConversionError(f"model {spec.id!r} has no gguf format to convert from")
    gguf = registry.resolve(spec, "gguf")
    progress(f"[1/2] GGUF -> Hugging Face fp32 (dequantising {gguf.name}) ...")
    with _staging(out) as tmp:
        gguf_to_hf(gguf, tmp)
    _write_manifest(out, spec, "hf", "fp32", None, gguf)
    return out


def gguf_to_hf(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF into a transformers checkpoint (weights, config, tokenizer, template)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers 5 refuses to save a model "quantized with gguf"; the weights are plain fp32
    # after loading, so the quantizer marker is stale and can go.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def hf_to_onnx(hf: Path, out: Path, precision: str, provider: str) -> None:
    """Run ORT GenAI's model builder on a local Hugging Face checkpoint."""
    work = out.parent / f".{out.name}-builder-cache"
    cmd = [
        sys.executable, "-m", "onnxruntime_genai.models.builder",
        "-m", str(hf), "-i", str(hf), "-o", str(out), "-p", precision, "-e", provider, "-c", str(work),
    ]
    log.debug("running %s", " ".join(cmd))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    try:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if proc.returncode != 0 or not (out / "genai_config.json").is_file():
        tail = "\n".join(proc.stdout.replace("\r", "\n").splitlines()[-15:])
        raise ConversionError(f"onnxruntime_genai.models.builder failed (exit {proc.returncode}):\n{tail}")


@contextmanager
def _staging(final: Path) -> Iterator[Path]:
    """A temporary folder that replaces `final` only if the block completes."""
    final.parent.mkdir(parents=True, exist_ok=True)
    # The leading dot keeps the registry from ever matching a half-written artifact.
    tmp = final.parent / f".{final.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def _write_manifest(out: Path, spec: ModelSpec, fmt: str, precision: str, provider: str | None, source: Path) -> None:
    manifest = {
        "model": spec.id, "format": fmt, "precision": precision, "provider": provider,
        "source": str(source), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
