"""Host memory for the host prefix cache: page-locked where the engine's device has it.

Copying a sequence's KV between a GPU and pageable host memory goes through the driver's staging
buffers: on an H100 80GB an 11k-token Llama-3-8B state (1.4 GiB) took ~1.3 s each way, as long as
prefilling it again (docs/benchmarks/history.md#a-host-memory-prefix-cache-and-a-prefill-budget), so the cache could not pay there. The device's own
host buffer type (`ggml_backend_dev_host_buffer_type`: `cudaMallocHost` on CUDA, pinned memory on
Vulkan) is copied by DMA (~50 GB/s measured there); `llama_state_seq_get_data`/`set_data` read
and write the caller's buffer directly, so an entry that lives in such memory moves at that speed.

Pinning is slow (the driver locks every page: ~0.5 s per GiB on that host) and holds the
driver while it runs, so the memory is pinned once, when the engine loads, as one arena of the
cache's bound; entries are ranges of it (best fit; freed ranges merge with their neighbours).
(Pinning lazily, in a thread beside a serving engine, stalled its CUDA calls for seconds: the
worker missed its heartbeats.) Where the device has no host buffer type (the CPU) or pinning
fails, entries are ordinary numpy memory.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Block:
    array: npt.NDArray[np.uint8]  # the bytes asked for (a view of the block)
    capacity: int = 0  # bytes the block takes; 0: none was free (PinnedHostMemory.take)
    handle: int | None = None  # its offset in the page-locked arena; None for numpy memory


class HostMemory:
    """Pageable numpy memory: what the CPU engine uses, and the fallback."""

    pinned = False  # whether blocks now come from page-locked memory
    allocations = 0  # page-locked allocations (one arena), and the seconds they took
    allocation_seconds = 0.0

    def take(self, size: int) -> Block:
        return Block(np.empty(size, dtype=np.uint8), size)  # not zeroed: the copy fills it

    def give(self, block: Block) -> None:
        """A block the cache no longer needs."""

    def close(self) -> None:
        """Free the memory (the engine is going away; no block is in use)."""


def _ggml_host_api() -> ctypes.CDLL:
    from engines.llamacpp.ggml_devices import _ggml

    lib = _ggml()
    vp = ctypes.c_void_p
    for fname, args, res in (
        ("ggml_backend_dev_host_buffer_type", [vp], vp),
        ("ggml_backend_buft_name", [vp], ctypes.c_char_p),
        ("ggml_backend_buft_alloc_buffer", [vp, ctypes.c_size_t], vp),
        ("ggml_backend_buffer_get_base", [vp], vp),
        ("ggml_backend_buffer_free", [vp], None),
    ):
        fn = getattr(lib, fname)
        fn.argtypes, fn.restype = args, res
    return lib


class PinnedHostMemory(HostMemory):
    """Ranges of one page-locked arena of `limit_bytes` (`pin` allocates it)."""

    PAGE = 4096

    def __init__(self, lib: Any, buft: int, limit_bytes: int) -> None:
        self._lib = lib
        self._buft = buft
        self.limit_bytes = -(-limit_bytes // self.PAGE) * self.PAGE
        self.name = (lib.ggml_backend_buft_name(buft) or b"").decode()
        self._lock = threading.Lock()
        self._arena: int | None = None  # the ggml buffer
        self._array: npt.NDArray[np.uint8] | None = None
        self._free: list[tuple[int, int]] = []  # (offset, length), by offset
        self.used = 0  # bytes of the arena the cache holds

    @classmethod
    def for_device(cls, device_key: str, limit_bytes: int) -> PinnedHostMemory | None:
        """The device's page-locked host memory, or None where it has none (the CPU)."""
        if not device_key:
            return None
        try:
            lib = _ggml_host_api()
            dev = lib.ggml_backend_dev_by_name(device_key.encode())
            buft = lib.ggml_backend_dev_host_buffer_type(dev) if dev else None
        except (OSError, AttributeError) as exc:
            log.info("no page-locked host memory for %s: %s", device_key, exc)
            return None
        return cls(lib, buft, limit_bytes) if buft else None

    def pin(self) -> bool:
        """Allocate the arena (seconds per GiB): whether it is there."""
        t0 = time.perf_counter()
        buf = self._lib.ggml_backend_buft_alloc_buffer(self._buft, self.limit_bytes)
        seconds = time.perf_counter() - t0
        with self._lock:
            self.allocations, self.allocation_seconds = 1, seconds
            if not buf:
                log.warning("could not pin %d MiB of host memory (%s) for the prefix cache: it stays in "
                            "pageable memory", self.limit_bytes >> 20, self.name)
                return False
            base = self._lib.ggml_backend_buffer_get_base(buf)
            self._array = np.ctypeslib.as_array((ctypes.c_uint8 * self.limit_bytes).from_address(base))
            self._free = [(0, self.limit_bytes)]
            self._arena = buf
        log.info("pinned %d MiB of host memory (%s) for the prefix cache in %.2f s",
                 self.limit_bytes >> 20, self.name, seconds)
        return True

    @property
    def pinned(self) -> bool:  # type: ignore[override]
        return self._arena is not None

    def take(self, size: int) -> Block:
        """A range of the arena (numpy memory without one). When the arena has no free range that
        large, an empty block (`capacity` 0): make room and retry."""
        with self._lock:
            if self._arena is None:
                return HostMemory().take(size)
            assert self._array is not None
            length = -(-size // self.PAGE) * self.PAGE
            fits = [(n, i) for i, (_, n) in enumerate(self._free) if n >= length]
            if not fits:
                return Block(self._array[:0], 0, None)
            _, i = min(fits)
            off, n = self._free[i]
            if n == length:
                del self._free[i]
            else:
                self._free[i] = (off + length, n - length)
            self.used += length
            return Block(self._array[off:off + size], length, off)

    def give(self, block: Block) -> None:
        if block.handle is None or self._array is None:
            return
        with self._lock:
            off, length = block.handle, block.capacity
            self.used -= length
            i = next((k for k, (o, _) in enumerate(self._free) if o > off), len(self._free))
            self._free.insert(i, (off, length))
            # Merge with the next range, then with the previous one.
            if i + 1 < len(self._free) and off + length == self._free[i + 1][0]:
                self._free[i] = (off, length + self._free.pop(i + 1)[1])
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
                po, pn = self._free[i - 1]
                self._free[i - 1] = (po, pn + self._free.pop(i)[1])

    def close(self) -> None:
        with self._lock:
            if self._arena is not None:
                self._lib.ggml_backend_buffer_free(self._arena)
            self._arena, self._array, self._free, self.used = None, None, [], 0
