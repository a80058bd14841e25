"""The engines' own settings, read from GATEWAY_* variables: worker processes inherit the gateway's
environment, so these reach every engine without a field in EngineConfig. Most are for measuring
side by side; the defaults are right for serving. `gateway serve` checks them at start, so a
malformed one is said there (docs/configuration.md lists them, generated from this model)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from engines.envconfig import EnvSettings, setting


class EngineTuning(EnvSettings):
    """Engine knobs (environment only)."""

    gc_freeze: bool = setting(True, "move start-up objects out of Python's collector once serving (engines/gcpause.py)")
    # Also the gateway's setting of the same name (Settings.cpu_variant): a process that loads
    # llama.cpp's CPU backend without being told a variant (the device probe) reads it here.
    cpu_variant: str | None = setting(None, "pin llama.cpp's CPU variant", shown="auto")
    executorch_vulkan_lib: str | None = setting(None, "ExecuTorch's Vulkan backend library", shown="the cached build")
    split_mixed: Literal["auto", "on", "off"] = setting(
        "auto", "llama.cpp: mixed steps of the shared KV layout in two passes (auto: on the CPU)")
    warmup: Literal["auto", "on", "off"] = setting(
        "auto", "llama.cpp: one pass of each serving shape at load (auto: on CUDA and ROCm)")
    trim_payback: float | None = setting(
        None, "llama.cpp: idle KV leaves a shared cache once it has cost N× its copies' time", ge=0, shown="`8`")
    prefix_follow: bool = setting(
        True, "llama.cpp: requests sharing a prefix another is prefilling wait for it and copy it "
        "(off: each prefills its own)")
    attach_defer: bool = setting(
        True, "llama.cpp: a device sampler chain is attached after the request's first pass (off: before it)")
    prefill_passes: int | None = setting(
        None, "llama.cpp: passes of prompt tokens one step may run beside running streams, which wait for them "
        "(more: a burst of prompts costs a stream one long gap instead of one per pass)", ge=1, le=64,
        shown="8 on CUDA, 1 elsewhere")
    passes_streams: int | None = setting(
        None, "llama.cpp: prompt passes only while at most N sequences are in use (their recent peak); "
        "with more, one chunk of `prefill_budget_many` tokens a step (0: passes at any load)", ge=0,
        shown="16 on CUDA with a KV stream per sequence, else 0")
    prefill_budget_many: int | None = setting(
        None, "llama.cpp: prompt tokens a step takes while more than `passes_streams` sequences are in use",
        ge=1, shown="128, or the prefill budget if smaller")
    overlap_outputs: Literal["auto", "on", "off"] = setting(
        "auto", "llama.cpp: a pass's tokens are turned into text and events while the next pass runs on the "
        "device (auto: on CUDA, whose passes run after llama_decode returns)")
    step_trace: str | None = setting(
        None, "write a trace of every scheduler step to DIR/steps-PID.json (Chrome's trace format: open it in "
        "Perfetto; `benchmarks/step_trace_summary.py` breaks it down)", shown="off")
    long_prompt_tokens: int = setting(
        0, "llama.cpp, experimental: prompts of at least N new tokens arriving while others decode are "
        "prefilled in a second context beside them (0: off)", ge=0)
    long_prompt_sms: int = setting(
        0, "llama.cpp, experimental: that context's kernels keep to this many SMs on a CUDA build patched "
        "for green contexts (0: all)", ge=0)


def engine_tuning(env: Mapping[str, str] | None = None) -> EngineTuning:
    """The engine knobs of the environment now (SettingError names a malformed one). Read when an
    engine loads, not at import: tests and benchmarks set them per run."""
    return EngineTuning.from_env(env)
