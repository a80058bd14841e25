"""Quantize a GGUF with llama.cpp's own `llama_model_quantize` (what `llama-quantize` runs), for
`/api/create`'s `quantize` and `gateway create -q`. It runs in a process of its own: a crash in
llama.cpp takes that process, not the gateway.

usage: python -m gateway.models.quantize SRC DST TYPE [--allow-requantize] [--threads N]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
from pathlib import Path

from gateway.models.gguf_info import FILE_TYPES

# What Ollama quantizes from; a quantized model quantized again loses more than either step alone.
SOURCES = ("F32", "F16", "BF16")
TYPES = {name: code for code, name in FILE_TYPES.items() if name not in ("F32", "MXFP4")}


class QuantizeError(RuntimeError):
    pass


def type_code(name: str) -> tuple[str, int]:
    """("Q4_K_M", 15) for "q4_K_M" (any case); ValueError listing the types for an unknown one."""
    key = name.upper()
    if key not in TYPES:
        raise ValueError(f"unknown quantization {name!r}; one of {', '.join(sorted(TYPES))}")
    return key, TYPES[key]


def quantize(src: Path, dst: Path, qtype: str, allow_requantize: bool = False, timeout: float = 6 * 3600) -> None:
    """`src` quantized to `qtype` into `dst`, in a child process; QuantizeError with its output's tail."""
    cmd = [sys.executable, "-m", "gateway.models.quantize", str(src), str(dst), qtype]
    if allow_requantize:
        cmd.append("--allow-requantize")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    except subprocess.TimeoutExpired as exc:
        dst.unlink(missing_ok=True)
        raise QuantizeError(f"quantizing {src.name} took more than {timeout:.0f} s") from exc
    if done.returncode != 0 or not dst.is_file():
        dst.unlink(missing_ok=True)
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise QuantizeError(f"quantizing {src.name} to {qtype} failed (exit {done.returncode}): {tail}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("type")
    ap.add_argument("--allow-requantize", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="0: every core")
    args = ap.parse_args()
    try:
        _, code = type_code(args.type)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from engines.runtimes import runtime

    llamacpp = runtime("llamacpp")
    assert llamacpp is not None
    llamacpp.prepare()  # its build's backends, loaded as its engine loads them
    import llama_cpp

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = code
    params.allow_requantize = args.allow_requantize
    params.nthread = args.threads
    rc = llama_cpp.llama_model_quantize(args.src.encode(), args.dst.encode(), ctypes.byref(params))
    if rc != 0:
        print(f"error: llama_model_quantize returned {rc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
