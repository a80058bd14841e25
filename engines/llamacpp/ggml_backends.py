"""ggml's loadable backends: which CPU variant a llama.cpp build runs, chosen before anything loads.

scripts/install-llama-cpp.sh builds llama.cpp with `GGML_BACKEND_DL` and a set of CPU variants
(`libggml-cpu-haswell.so`, `libggml-cpu-icelake.so`, `libggml-cpu-sapphirerapids.so` …), as
llama.cpp's own releases ship it, so one wheel runs on any x86-64 host. Left to itself ggml
would look for them beside the Python executable and in the current directory (it finds none
there) and load the highest-scoring one; here the gateway loads them from the build's own folder
and picks the CPU variant:

- `auto`: the fastest variant this CPU supports, except AMX ones — ggml's AMX kernel segfaults on
  the first batched prompt (llama.cpp issue 20824, open) and AMX is only taken when asked for;
- a variant's name (`GATEWAY_CPU_VARIANT=haswell`, or the fallback ladder's last step) pins it.

A build without loadable backends (a native build, Metal, Windows) has them compiled in: nothing
to choose, and `ensure_loaded` does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from engines.tuning import EngineTuning

log = logging.getLogger(__name__)

# Variants whose kernels are known to crash; `auto` passes over them.
AMX_VARIANTS = frozenset({"sapphirerapids"})
AVX512_VARIANTS = frozenset({"skylakex", "cannonlake", "cascadelake", "icelake", "cooperlake", "zen4",
                             "sapphirerapids"})
_PREFIX, _SUFFIX = "libggml-", ".so"


@dataclass(frozen=True)
class Variant:
    name: str  # ggml's tag: "haswell", "icelake", "sapphirerapids" …
    path: str
    score: int  # ggml_backend_score() on this CPU; 0 = the CPU lacks an instruction it needs

    @property
    def amx(self) -> bool:
        return self.name in AMX_VARIANTS


def lib_dir() -> Path:
    """The folder of the llama.cpp build this process uses (LLAMA_CPP_LIB_PATH, else the package's)."""
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    if override:
        return Path(override)
    import llama_cpp

    return Path(llama_cpp.__file__).resolve().parent / "lib"


def modules(directory: Path) -> dict[str, list[Path]]:
    """The loadable backend modules in `directory`, by backend: {"cpu": [...variants], "vulkan": [...]}."""
    out: dict[str, list[Path]] = {}
    for p in sorted(directory.glob(f"{_PREFIX}*{_SUFFIX}")):
        rest = p.name[len(_PREFIX):-len(_SUFFIX)]
        if rest in ("base", "") or not p.is_file():
            continue
        backend = rest.split("-", 1)[0]
        out.setdefault(backend, []).append(p)
    return out


def variant_name(path: Path) -> str:
    rest = path.name[len(_PREFIX):-len(_SUFFIX)]
    return rest.split("-", 1)[1] if "-" in rest else "default"


def _score(path: Path) -> int:
    # ggml does the same to rank variants: open each and ask. A variant that needs instructions
    # this CPU lacks answers 0 (its own code is not run beyond that check).
    lib = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL)
    fn = getattr(lib, "ggml_backend_score", None)
    if fn is None:
        return 0
    fn.restype = ctypes.c_int
    fn.argtypes = []
    return int(fn())


def variants(directory: Path | None = None) -> list[Variant]:
    """The CPU variants of a build, fastest first (each with its score on this CPU)."""
    d = directory or lib_dir()
    found = [Variant(variant_name(p), str(p), _score(p)) for p in modules(d).get("cpu", [])]
    return sorted(found, key=lambda v: -v.score)


def choose(found: list[Variant], wanted: str = "auto") -> Variant:
    """The variant to load: `wanted` by name, or for auto the fastest supported one that is not AMX."""
    supported = [v for v in found if v.score > 0]
    if not supported:
        raise OSError("no CPU variant of this llama.cpp build runs on this CPU "
                      f"(it has: {', '.join(v.name for v in found) or 'none'})")
    if wanted and wanted != "auto":
        for v in found:
            if v.name == wanted:
                if v.score <= 0:
                    raise OSError(f"CPU variant {wanted!r} needs instructions this CPU lacks "
                                  f"(supported: {', '.join(v.name for v in supported)})")
                return v
        raise OSError(f"this llama.cpp build has no CPU variant {wanted!r} "
                      f"(it has: {', '.join(v.name for v in found)})")
    return next((v for v in supported if not v.amx), supported[0])


def lower(found: list[tuple[str, int]], current: str) -> str | None:
    """The ladder's step down from `current`, given (variant, score) pairs: the fastest supported
    variant below it without AVX-512 (AVX2 class) when `current` has AVX-512, else the next one
    down; None at the bottom."""
    supported = sorted(((n, sc) for n, sc in found if sc > 0), key=lambda v: -v[1])
    cur = next((sc for n, sc in supported if n == current), None)
    below = [n for n, sc in supported if cur is None or sc < cur]
    if not below:
        return None
    if current in AVX512_VARIANTS:
        plain = [n for n in below if n not in AVX512_VARIANTS]
        if plain:
            return plain[0]
    return below[0]


_loaded: str | None = None  # the CPU variant this process loaded ("" = compiled in)


def _mapped_ggml() -> str | None:
    """The libggml file this process has mapped (Linux): the one libllama linked against."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if Path(path).name.startswith("libggml.so"):
            return path
    return None


def ggml_lib() -> ctypes.CDLL:
    """The libggml that libllama uses. A wheel holds libggml.so, .so.0 and .so.0.x as separate
    copies (zip has no links), and opening another copy than libllama's would get a second ggml
    with its own, empty backend registry: the mapped one is opened again instead."""
    import llama_cpp  # noqa: F401 - loads libllama and, with it, libggml

    mapped = _mapped_ggml()
    if mapped:
        return ctypes.CDLL(mapped)
    d = lib_dir()
    for name in ("libggml.so.0", "libggml.so", "libggml.dylib", "ggml.dll"):
        if (d / name).exists():
            return ctypes.CDLL(str(d / name))
    raise OSError(f"libggml not found in {d}")


def ensure_loaded(wanted: str | None = None) -> str:
    """Register this build's backends with ggml once per process, the CPU as `wanted`
    (default: $GATEWAY_CPU_VARIANT, else auto). Returns the CPU variant loaded ("" when the build
    has its backends compiled in). Must run before llama_backend_init()."""
    global _loaded
    if _loaded is not None:
        if wanted and wanted not in ("auto", _loaded) and _loaded:
            log.warning("CPU variant %s is loaded in this process; %s is used only in a new process", _loaded, wanted)
        return _loaded
    lib = ggml_lib()
    lib.ggml_backend_reg_count.restype = ctypes.c_size_t
    if lib.ggml_backend_reg_count() > 0:  # compiled-in backends (or someone loaded them already)
        _loaded = ""
        return _loaded
    d = lib_dir()
    found = modules(d)
    if "cpu" not in found:
        _loaded = ""
        return _loaded
    lib.ggml_backend_load.restype = ctypes.c_void_p
    lib.ggml_backend_load.argtypes = [ctypes.c_char_p]
    for backend, paths in found.items():
        if backend == "cpu":
            continue
        for p in paths:  # GPU backends: one module each (a failure is the device probe's to explain)
            if not lib.ggml_backend_load(str(p).encode()):
                log.warning("ggml could not load the %s backend %s", backend, p)
    choice = choose(variants(d), wanted or EngineTuning.read("cpu_variant") or "auto")
    if not lib.ggml_backend_load(choice.path.encode()):
        raise OSError(f"ggml could not load the CPU backend {choice.path}")
    _loaded = choice.name
    log.debug("CPU backend: %s (%s)", choice.name, choice.path)
    return _loaded


def load_variant(wanted: str) -> str | None:
    """`ensure_loaded` for an engine: its failures as ModelLoadError, and a variant other than the
    one asked for (`wanted`, "" = auto) refused (a process loads one)."""
    from engines.base import ModelLoadError

    try:
        variant = ensure_loaded(wanted or None)
    except OSError as exc:
        raise ModelLoadError(str(exc)) from exc
    if wanted and variant and wanted != variant:
        raise ModelLoadError(f"CPU variant {wanted} was asked for, but this process runs {variant} "
                             "(a process loads one; engines in worker processes can each choose)")
    return variant
