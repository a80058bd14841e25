"""`gateway convert`: a model's GGUF -> Hugging Face checkpoint -> ORT GenAI, CoreML or ExecuTorch artifact.

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

from gateway.models.registry import ModelSpec, Registry

log = logging.getLogger(__name__)

TARGETS = ("onnx", "coreml", "executorch")
DELEGATES = ("xnnpack", "vulkan")  # ExecuTorch: what the program is lowered to
PRECISIONS = ("fp32", "fp16", "int4")
ONNX_PROVIDERS = ("cpu", "cuda", "dml")
MANIFEST = "gateway-artifact.json"
# What each step imports, so a missing piece is reported before minutes of work.
_NEEDS = {
    "hf": ("torch", "transformers", "gguf", "accelerate"),
    "onnx": ("onnx", "onnx_ir", "onnxruntime_genai"),
    "coreml": ("coremltools",),
    "executorch": ("executorch",),
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
    show_output: bool = False,
    delegate: str = "xnnpack",
) -> Path:
    """Produce (or find) the `to` artifact of `spec`; returns its folder.  Blocking, minutes.

    Each heavy step runs in a child process (torch and the converters never load into the
    caller); `show_output` lets their own progress bars through to the terminal.
    """
    if to not in TARGETS:
        raise ConversionError(f"unknown target {to!r}; one of {', '.join(TARGETS)}")
    if precision not in PRECISIONS:
        raise ConversionError(f"unknown precision {precision!r}; one of {', '.join(PRECISIONS)}")
    if to == "onnx" and provider not in ONNX_PROVIDERS:
        raise ConversionError(f"unknown provider {provider!r}; one of {', '.join(ONNX_PROVIDERS)}")
    if to == "coreml" and precision == "fp32":
        precision = "fp16"  # CoreML ML programs compute in fp16 on the GPU and Neural Engine
        progress("CoreML: using fp16 (ML programs run fp16 on the GPU / Neural Engine)")
    if to == "executorch":
        if delegate not in DELEGATES:
            raise ConversionError(f"unknown delegate {delegate!r}; one of {', '.join(DELEGATES)}")
        if precision != "fp32":
            raise ConversionError("ExecuTorch programs are exported in fp32 for now (--precision fp32)")
    fmt, variant = {"onnx": ("onnx", provider), "coreml": ("coreml", None), "executorch": ("pte", delegate)}[to]
    out = registry.converted_dir(spec, fmt, precision, variant)
    if (out / MANIFEST).is_file() and not force:  # a finished artifact needs no converter installed
        progress(f"{spec.id}: {out.name} already converted: {out}")
        return out
    missing = missing_modules(to)
    if missing:
        raise ConversionError(
            f"converting to {to} needs {', '.join(missing)}: pip install -e '.[convert{',executorch' if to == 'executorch' else ''}]'"
        )
    t0 = time.perf_counter()
    hf = hf_checkpoint(registry, spec, progress, show_output)
    with _staging(out) as tmp:
        if to == "onnx":
            progress(f"[2/2] Hugging Face -> ORT GenAI ({precision}, provider {provider}) ...")
            hf_to_onnx(hf, tmp, precision, provider, show_output)
        elif to == "executorch":
            progress(f"[2/2] Hugging Face -> ExecuTorch program (fp32, static KV cache, {delegate}) ...")
            _run_step(
                [sys.executable, "-m", "gateway.models.executorch_export", str(hf), str(tmp), delegate,
                 str(spec.context_length)],
                "ExecuTorch export", show_output,
            )
            report = json.loads((tmp / "partition.json").read_text())
            progress(f"partition ({delegate}): {report['delegated_ops']} operators delegated in "
                     f"{report['delegate_calls']} call(s) ({report['delegated_share']:.0%}); on portable CPU "
                     f"kernels: {', '.join(f'{k} x{v}' for k, v in report['fallback'].items()) or 'none'}")
        else:
            progress(f"[2/2] Hugging Face -> CoreML ML program ({precision}, stateful KV cache) ...")
            _run_step(
                [sys.executable, "-m", "gateway.models.coreml_export", str(hf), str(tmp), precision, str(spec.context_length)],
                "CoreML conversion", show_output,
            )
    _write_manifest(out, spec, fmt, precision, variant, hf)
    progress(f"{spec.id}: wrote {out} in {time.perf_counter() - t0:.0f}s")
    return out


def hf_checkpoint(
    registry: Registry, spec: ModelSpec, progress: Progress = log.info, show_output: bool = False
) -> Path:
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
        _run_step([sys.executable, "-m", "gateway.models.convert", "gguf-to-hf", str(gguf), str(tmp)],
                  "GGUF -> Hugging Face", show_output)
    _write_manifest(out, spec, "hf", "fp32", None, gguf)
    return out


def gguf_to_hf(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF into a transformers checkpoint (weights, config, tokenizer, template)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers 5 refuses to save a model "quantized with gguf"; the weights are plain fp32
    # after loading, so the quantizer marker is stale and can go.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    repair_byte_level_decoder(out / "tokenizer.json")


ROUND_TRIP_PROBE = "Hello, world!\nThe capital of France is Paris."


def repair_byte_level_decoder(path: Path) -> bool:
    """Give a byte-level BPE tokenizer the byte-level decoder it needs; True when it was changed.

    Some transformers releases (5.17 on the H100 host) write a GGUF's GPT-2-style tokenizer with
    a SentencePiece decoder chain (ByteFallback, Fuse, Replace "▁") in front of ByteLevel. The
    `tokenizers` library copes, ONNX Runtime GenAI's tokenizer does not: spaces decode as
    `<|endoftext|>` and chat answers come out as garbage. Verified by a round trip afterwards.
    """
    if not path.is_file():
        return False
    data = json.loads(path.read_text())
    pre = data.get("pre_tokenizer") or {}
    pres = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if not any(p.get("type") == "ByteLevel" for p in pres if isinstance(p, dict)):
        return False
    decoder = data.get("decoder") or {}
    if decoder.get("type") == "ByteLevel":
        return False
    data["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    path.write_text(json.dumps(data, ensure_ascii=False))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    back = tok.decode(tok.encode(ROUND_TRIP_PROBE, add_special_tokens=False).ids)
    if back != ROUND_TRIP_PROBE:
        raise ConversionError(f"the converted tokenizer does not round-trip text even with a byte-level decoder: {back!r}")
    return True


def hf_to_onnx(hf: Path, out: Path, precision: str, provider: str, show_output: bool = False) -> None:
    """Run ORT GenAI's model builder on a local Hugging Face checkpoint."""
    work = out.parent / f".{out.name}-builder-cache"
    cmd = [
        sys.executable, "-m", "onnxruntime_genai.models.builder",
        "-m", str(hf), "-i", str(hf), "-o", str(out), "-p", precision, "-e", provider, "-c", str(work),
    ]
    try:
        _run_step(cmd, "onnxruntime_genai.models.builder", show_output)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not (out / "genai_config.json").is_file():
        raise ConversionError(f"onnxruntime_genai.models.builder wrote no genai_config.json into {out}")


def _run_step(cmd: list[str], what: str, show_output: bool) -> None:
    log.debug("running %s", " ".join(cmd))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # everything is local; never reach for the hub
    if show_output:
        rc = subprocess.run(cmd, env=env, check=False).returncode
        tail = ""
    else:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
        rc = proc.returncode
        tail = "\n" + "\n".join(proc.stdout.replace("\r", "\n").splitlines()[-15:])
    if rc != 0:
        raise ConversionError(f"{what} failed (exit {rc}){tail}")


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


if __name__ == "__main__":  # the child-process entry of one step: gguf-to-hf GGUF OUT
    if len(sys.argv) != 4 or sys.argv[1] != "gguf-to-hf":
        sys.exit("usage: python -m gateway.models.convert gguf-to-hf GGUF OUT")
    gguf_to_hf(Path(sys.argv[2]), Path(sys.argv[3]))
