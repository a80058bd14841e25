"""A trace of a scheduler's passes that a reader can open: Chrome's trace format (a JSON array of
complete events; Perfetto and chrome://tracing read it with or without its closing bracket, so a
process that dies leaves a readable file). One file per process, `DIR/steps-PID.json`, written
only when `GATEWAY_STEP_TRACE=DIR` is set (engines/tuning.py); `benchmarks/step_trace_summary.py`
says where the time between tokens went.

Each step is a span (`step`: what it decoded and prefilled, how many sequences ran) holding the
model pass (`llama_decode`) and the host's work on its outputs (`outputs`: sampling, stop strings,
events); the space between two steps is the scheduler's own time (admission, waiting for work)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import IO, Any

FLUSH_S = 1.0  # written at least this often, so a killed process loses at most a second


class StepTrace:
    def __init__(self, directory: str | Path, name: str) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.path = d / f"steps-{os.getpid()}.json"
        self._file: IO[str] = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        self._flushed = time.perf_counter()
        self._tid = threading.get_ident() % 100_000
        if self._file.tell() == 0:
            self._file.write("[\n")
        self._write({"ph": "M", "name": "process_name", "pid": os.getpid(), "args": {"name": name}})

    @staticmethod
    def us(t: float) -> float:
        """A perf_counter time in the trace's microseconds."""
        return round(t * 1e6, 1)

    def span(self, name: str, start: float, end: float, **args: Any) -> None:
        self._write({"ph": "X", "name": name, "pid": os.getpid(), "tid": self._tid, "ts": self.us(start),
                     "dur": self.us(end - start), "args": args})

    def _write(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._file.write(json.dumps(event, separators=(",", ":")) + ",\n")
            now = time.perf_counter()
            if now - self._flushed >= FLUSH_S:
                self._file.flush()
                self._flushed = now

    def close(self) -> None:
        with self._lock:
            self._file.flush()
            self._file.close()


_open: dict[str, StepTrace] = {}


def open_trace(directory: str | None, name: str) -> StepTrace | None:
    """This process's trace in `directory` (None: not tracing); every scheduler of the process
    writes to the one file."""
    if not directory:
        return None
    if directory not in _open:
        _open[directory] = StepTrace(directory, name)
    return _open[directory]
