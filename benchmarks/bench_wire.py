"""The cost of the gateway <-> worker wire encoding: msgspec msgpack (what engines/worker/wire.py uses) against
pickle and JSON, for the two messages that matter: one scheduler step's token events for N sequences
(worker -> gateway, every step) and a chat request (gateway -> worker, once per request).

    .venv/bin/python benchmarks/bench_wire.py
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import platform
import time
from collections.abc import Callable
from typing import Any

from engines.base import GenerationRequest, SamplingParams, TokenEvent
from engines.worker import wire


def _best(fn: Callable[[], Any], n: int = 2000, repeat: int = 5) -> float:
    """Best-of-`repeat` microseconds per call."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def _step(sequences: int) -> wire.Events:
    return wire.Events([(i, TokenEvent(" token", (1234,))) for i in range(sequences)])


def main() -> None:
    prompt = "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n" + "Hi " * 200 + \
        "<|im_end|>\n<|im_start|>assistant\n"
    request = GenerationRequest("chatcmpl-1", SamplingParams(temperature=0.7, top_p=0.9, max_tokens=128),
                                prompt=prompt, templated=True)
    print(f"# wire encodings, {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print("| message | msgspec msgpack (µs, bytes) | pickle (µs, bytes) | json (µs, bytes) |")
    print("|---|---|---|---|")
    cases: list[tuple[str, wire._Msg]] = [(f"step, {n} sequences", _step(n)) for n in (1, 8, 16)]
    cases.append(("chat request", wire.Generate(1, request)))
    for name, msg in cases:
        body = wire.frame(msg)[4:]
        decode = wire.decode_for_gateway if isinstance(msg, wire.Events) else wire.decode_for_worker
        ms = _best(lambda msg=msg, decode=decode: decode(wire.frame(msg)[4:]))
        pk = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        pt = _best(lambda msg=msg: pickle.loads(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)))
        # JSON of the same data (decoding back to plain dicts only: the cheapest JSON can do).
        plain = ([[i, dataclasses.asdict(e)] for i, e in msg.items] if isinstance(msg, wire.Events)
                 else dataclasses.asdict(request))
        js = json.dumps(plain)
        jt = _best(lambda plain=plain: json.loads(json.dumps(plain)))
        print(f"| {name} | {ms:.1f}, {len(body)} | {pt:.1f}, {len(pk)} | {jt:.1f}, {len(js)} |")


if __name__ == "__main__":
    main()
