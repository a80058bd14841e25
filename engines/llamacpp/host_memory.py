"""Host memory for the host prefix cache: page-locked where the engine's device has it.

Copying a sequence's KV between a GPU and pageable host memory goes through the driver's staging
buffers: on the H100 an 11k-token Llama-3-8B state (1.4 GiB) took ~1.3 s each way, as long as
prefilling it again (BENCHMARKS.md, issue 28), so the cache could not pay there. The device's own
host buffer type (`ggml_backend_dev_host_buffer_type`: `cudaMallocHost` on CUDA, pinned memory on
Vulkan) is copied by DMA; `llama_state_seq_get_data`/`set_data` read and write the caller's
buffer directly, so an entry that lives in such memory moves at the link's speed.

Pinning memory is slow (the driver locks every page) and a conversation's entry is replaced by a
slightly longer one each turn, so freed blocks are kept and handed to the next entry that fits;
blocks are allocated with 1/16 headroom for that. What is pinned, in use and kept, stays within
its bound (the engine gives it the cache's plus 1/8, for the headroom). Where the device has no host buffer type (the CPU) or pinning fails,
entries are ordinary numpy memory.
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

ALIGN = 2 << 20


@dataclass(eq=False)
class Block:
    array: npt.NDArray[np.uint8]  # the bytes asked for (a view of the block)
    capacity: int = 0
    handle: int | None = None  # the ggml buffer; None for numpy memory


class HostMemory:
    """Pageable numpy memory: what the CPU engine uses, and the fallback."""

    pinned = False
    allocations = 0  # page-locked blocks allocated (not reused), and the time that took
    allocation_seconds = 0.0

    def take(self, size: int) -> Block:
        return Block(np.empty(size, dtype=np.uint8), size)  # not zeroed: the copy fills it

    def give(self, block: Block) -> None:
        """A block the cache no longer needs."""

    def close(self) -> None:
        """Free what is kept (the engine is going away)."""


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
    """Blocks of the device's host buffer type, reused once freed, within `limit_bytes` in all."""

    pinned = True

    def __init__(self, lib: Any, buft: int, limit_bytes: int) -> None:
        self._lib = lib
        self._buft = buft
        self.limit_bytes = limit_bytes
        self.name = (lib.ggml_backend_buft_name(buft) or b"").decode()
        self._free: list[Block] = []  # kept for reuse, smallest first
        self._lock = threading.Lock()
        self.used = 0  # capacity of the blocks the cache holds
        self.kept = 0  # capacity of the blocks kept for reuse
        self.failed = 0  # allocations that fell back to numpy memory

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

    def take(self, size: int) -> Block:
        with self._lock:
            # The smallest kept block that fits without wasting more than half of it.
            for i, b in enumerate(self._free):
                if size <= b.capacity <= 2 * size + ALIGN:
                    del self._free[i]
                    self.kept -= b.capacity
                    self.used += b.capacity
                    return Block(b.array[:size], b.capacity, b.handle)
            capacity = -(-(size + size // 16) // ALIGN) * ALIGN
            # Room for it: kept blocks go first, largest first (the cache bounds what it holds).
            while self._free and self.used + self.kept + capacity > self.limit_bytes:
                b = self._free.pop()
                self.kept -= b.capacity
                self._lib.ggml_backend_buffer_free(b.handle)
            t0 = time.perf_counter()
            buf = self._lib.ggml_backend_buft_alloc_buffer(self._buft, capacity)
            self.allocations += 1
            self.allocation_seconds += time.perf_counter() - t0
            if not buf:
                self.failed += 1
                return HostMemory().take(size)
            base = self._lib.ggml_backend_buffer_get_base(buf)
            array = np.ctypeslib.as_array((ctypes.c_uint8 * capacity).from_address(base))
            self.used += capacity
            return Block(array[:size], capacity, buf)

    def give(self, block: Block) -> None:
        if block.handle is None:
            return
        with self._lock:
            self.used -= block.capacity
            if self.used + self.kept + block.capacity > self.limit_bytes:
                self._lib.ggml_backend_buffer_free(block.handle)
                return
            whole = np.ctypeslib.as_array((ctypes.c_uint8 * block.capacity).from_address(block.array.ctypes.data))
            self._free.append(Block(whole, block.capacity, block.handle))
            self._free.sort(key=lambda b: b.capacity)
            self.kept += block.capacity

    def close(self) -> None:
        with self._lock:
            for b in self._free:
                self._lib.ggml_backend_buffer_free(b.handle)
            self._free.clear()
            self.kept = 0
