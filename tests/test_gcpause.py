"""The serving processes' garbage collection: start-up objects frozen, long collections logged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import gc, logging, sys
logging.basicConfig(level="DEBUG", stream=sys.stdout, format="%(name)s %(message)s")
import gateway.app  # what a serving process has loaded by then
from engines import gcpause
before = gc.get_freeze_count()
froze = gcpause.settle()
print("FROZE", froze, before, gc.get_freeze_count())
gcpause.LONG_MS = 0.0  # every collection counts as long now
junk = [[i] for i in range(200000)]; loop = [junk]; loop.append(loop); del junk, loop
gc.collect()
print("LONGEST", gcpause.watch().longest_ms, gcpause.watch().long_pauses)
"""


def _probe(**env: str) -> str:
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_start_up_objects_are_frozen_and_long_collections_logged() -> None:
    out = _probe()
    froze, before, after = next(ln.split()[1:] for ln in out.splitlines() if ln.startswith("FROZE"))
    assert froze == "True" and int(before) == 0 and int(after) > 10_000  # imports, schemas, routes
    assert "gc froze" in out
    longest, pauses = next(ln.split()[1:] for ln in out.splitlines() if ln.startswith("LONGEST"))
    assert float(longest) > 0 and int(pauses) >= 1
    assert "gc generation 2 collected in" in out and "objects freed" in out


def test_gc_freeze_can_be_turned_off() -> None:
    out = _probe(GATEWAY_GC_FREEZE="0")
    froze, _, after = next(ln.split()[1:] for ln in out.splitlines() if ln.startswith("FROZE"))
    assert froze == "False" and int(after) == 0
