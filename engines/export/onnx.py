"""Hugging Face checkpoint -> ORT GenAI model folder, by ONNX Runtime GenAI's own model builder
(run as a child process)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from engines.runtimes import ConversionError, ConvertJob, run_step


def hf_to_onnx(hf: Path, out: Path, precision: str, provider: str, show_output: bool = False) -> None:
    """Run ORT GenAI's model builder on a local Hugging Face checkpoint."""
    work = out.parent / f".{out.name}-builder-cache"
    cmd = [
        sys.executable, "-m", "onnxruntime_genai.models.builder",
        "-m", str(hf), "-i", str(hf), "-o", str(out), "-p", precision, "-e", provider, "-c", str(work),
    ]
    try:
        run_step(cmd, "onnxruntime_genai.models.builder", show_output)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not (out / "genai_config.json").is_file():
        raise ConversionError(f"onnxruntime_genai.models.builder wrote no genai_config.json into {out}")


def convert(job: ConvertJob) -> None:
    job.progress(f"[2/2] Hugging Face -> ORT GenAI ({job.precision}, provider {job.variant}) ...")
    hf_to_onnx(job.checkpoint, job.out, job.precision, job.variant or "cpu", job.show_output)
