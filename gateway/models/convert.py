"""`gateway convert`: a model's GGUF -> Hugging Face checkpoint -> the artifact of a runtime that does not
read GGUF (ORT GenAI, CoreML, ExecuTorch, or a plug-in's: each runtime's `Converter`, engines/runtimes.py).

Artifacts go into the model cache at `<cache>/converted/<id>/<format>-<precision>[-<provider>]`
(`Registry.converted_dir`), written under a temporary name and renamed when complete, then
marked finished by `gateway-artifact.json`; `Registry.resolve(spec, "onnx")` finds them.  The
intermediate Hugging Face checkpoint (fp32, dequantised from the GGUF) is cached beside them and
reused.  Needs the `convert` extra (torch, transformers, gguf) and what the target names.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from engines.runtimes import ConversionError, Converter, ConvertJob, converters, run_step, runtimes
from gateway.models.registry import ModelSpec, Registry

__all__ = ["MANIFEST", "ConversionError", "convert", "hf_checkpoint", "missing_modules", "targets"]

log = logging.getLogger(__name__)

MANIFEST = "gateway-artifact.json"
# What the first step (GGUF -> Hugging Face checkpoint) imports; each target adds its own.
CHECKPOINT_NEEDS = ("torch", "transformers", "gguf", "accelerate")

Progress = Callable[[str], None]


def targets() -> dict[str, Converter]:
    """`--to`'s targets: those of the registered runtimes (plug-ins' too)."""
    return converters()


def missing_modules(target: str) -> list[str]:
    """Python modules the conversion to `target` needs that are not installed."""
    return [m for m in (*CHECKPOINT_NEEDS, *targets()[target].needs) if importlib.util.find_spec(m) is None]


def _choose(c: Converter, precision: str, variant: str | None, progress: Progress) -> tuple[str, str | None]:
    """The precision and variant `c` builds for these, or ConversionError naming what it takes."""
    if precision not in c.precisions:
        raise ConversionError(f"{c.target} takes precision {' or '.join(c.precisions)}, not {precision!r}")
    if precision in c.substitutes:
        precision, why = c.substitutes[precision]
        progress(f"{c.target}: using {precision} ({why})")
    if not c.variants:
        return precision, None
    variant = variant or c.variants[0]
    if variant not in c.variants:
        raise ConversionError(f"unknown {c.variant_flag} {variant!r} for {c.target}; one of {', '.join(c.variants)}")
    return precision, variant


def convert(
    registry: Registry,
    spec: ModelSpec,
    to: str,
    precision: str = "fp32",
    variant: str | None = None,
    progress: Progress = log.info,
    force: bool = False,
    show_output: bool = False,
) -> Path:
    """Produce (or find) the `to` artifact of `spec` (built for `variant`: an execution provider or
    delegate, the target's first when None); returns its folder.  Blocking, minutes.

    Each heavy step runs in a child process (torch and the converters never load into the
    caller); `show_output` lets their own progress bars through to the terminal.
    """
    c = targets().get(to)
    if c is None:
        raise ConversionError(f"unknown target {to!r}; one of {', '.join(targets())}")
    precision, variant = _choose(c, precision, variant, progress)
    fmt = next(rt.format for rt in runtimes() if rt.convert is c)
    out = registry.converted_dir(spec, fmt, precision, variant)
    if (out / MANIFEST).is_file() and not force:  # a finished artifact needs no converter installed
        progress(f"{spec.id}: {out.name} already converted: {out}")
        return out
    missing = missing_modules(to)
    if missing:
        raise ConversionError(f"converting to {to} needs {', '.join(missing)}: {c.install or 'pip install them'}")
    t0 = time.perf_counter()
    hf = hf_checkpoint(registry, spec, progress, show_output)
    with _staging(out) as tmp:
        c.run(ConvertJob(hf, tmp, precision, variant, spec.context_length, show_output, progress))
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
        run_step([sys.executable, "-m", "gateway.models.convert", "gguf-to-hf", str(gguf), str(tmp)],
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
