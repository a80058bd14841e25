"""Python's garbage collector in a serving process.

A collection holds the interpreter lock: while it runs, every thread of the process waits (a worker's
decode loops between their llama_decode calls, the gateway's event loop sending every stream's
chunks). A full collection walks every live object, and a serving process keeps hundreds of
thousands from start-up (modules, schemas, the vocabulary) that will never be garbage (the gateway's
~88k took 60 ms to walk on a 2-core CPU). On an H100 80GB with 32 streams an A/B showed no difference
in their gaps (docs/benchmarks/history.md#streams-timed-per-token): it bounds a pause that was not the one seen there.

`settle()` (after start-up) moves what exists then out of the collector's view (`gc.freeze()`, as
CPython's documentation advises for servers); `GATEWAY_GC_FREEZE=0` leaves it. `watch()` logs every
collection longer than a few milliseconds at debug level, so a stall in a trace can be told from one.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from engines.tuning import EngineTuning

log = logging.getLogger("gc")
LONG_MS = 5.0


class _Watch:
    def __init__(self) -> None:
        self.started = 0.0
        self.longest_ms = 0.0
        self.long_pauses = 0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        ms = (time.perf_counter() - self.started) * 1000
        self.longest_ms = max(self.longest_ms, ms)
        if ms >= LONG_MS:
            self.long_pauses += 1
            log.debug("generation %d collected in %.1f ms (%d objects freed)", info.get("generation", -1), ms,
                      info.get("collected", 0))


_watch: _Watch | None = None


def watch() -> _Watch:
    """Time this process's collections (once per process); long ones are logged at debug level."""
    global _watch
    if _watch is None:
        _watch = _Watch()
        gc.callbacks.append(_watch)
    return _watch


def settle() -> bool:
    """After start-up: collect once, then keep what is left out of later collections. Returns
    whether it froze (GATEWAY_GC_FREEZE=0: no)."""
    watch()
    if not EngineTuning.read("gc_freeze"):
        return False
    gc.collect()
    gc.freeze()
    log.debug("froze %d objects of start-up", gc.get_freeze_count())
    return True
