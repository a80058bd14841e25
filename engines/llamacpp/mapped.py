"""The model file's mapped pages, given back after load.

llama.cpp maps the GGUF and copies each tensor it repacks for the CPU's kernels (weights in
`CPU_REPACK` buffers) out of the mapping; the file pages it read stay resident in the process,
so those weights count twice in its memory (llama.cpp issue 16761: on a 16-core AMX Xeon an
8B-shaped Q4_K_M model kept 4.7 GiB of file pages beside ~3.4 GiB of repacked copies,
docs/benchmarks/history.md#weights-resident-twice-on-the-cpu). `release` drops the mapping's pages from the process
(`madvise(MADV_DONTNEED)`: the mapping stays valid, read-only, and a page still used, such as a
tensor served from the mapping, is faulted back in from the page cache the next time it is read),
so what stays resident is what the model uses. Linux only; elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

MADV_DONTNEED = 4


def _ranges(path: str, maps: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """The address ranges of this process's read-only mappings of `path`."""
    real = os.path.realpath(path)
    out = []
    with open(maps) as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == real and "w" not in fields[1]:
                start, _, end = fields[0].partition("-")
                out.append((int(start, 16), int(end, 16)))
    return out


def release(path: str) -> int:
    """Drop the resident pages of this process's mappings of `path`; the bytes advised (0 where the
    platform has no /proc or madvise)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        ranges = _ranges(path)
    except OSError:
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    done = 0
    for start, end in ranges:
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED) == 0:
            done += end - start
        else:
            log.debug("madvise on %s failed: %s", path, os.strerror(ctypes.get_errno()))
    return done
