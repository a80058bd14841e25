"""The model file's mapped pages are given back after load (engines/llamacpp/mapped.py): the
mapping's resident pages drop to none, and the mapping still reads the file's bytes."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest

from engines.llamacpp.mapped import _ranges, release

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise: Linux only")


def _resident(path: Path) -> int:
    """Bytes of this process's mappings of `path` that are resident (/proc/self/smaps)."""
    real, total, inside = str(path.resolve()), 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            inside = len(head) == 6 and head[5] == real
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


def test_release_drops_the_mapped_pages_and_keeps_the_bytes(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    data = bytes(range(256)) * (16 * 1024 * 1024 // 256)  # 16 MiB
    path.write_bytes(data)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert sum(m[i + 1] for i in range(0, len(m), 4096)) > 0  # every page touched
        assert len(_ranges(str(path))) == 1
        before = _resident(path)
        assert before >= 15 * 1024 * 1024, before
        assert release(str(path)) >= len(data)
        assert _resident(path) < 1024 * 1024  # given back
        assert m[: 1 << 20] == data[: 1 << 20] and m[-4096:] == data[-4096:]  # still the file's bytes
        assert _resident(path) > 0  # what is read again is resident again


def test_release_of_a_file_not_mapped_does_nothing(tmp_path: Path) -> None:
    path = tmp_path / "other.bin"
    path.write_bytes(b"x" * 4096)
    assert release(str(path)) == 0
