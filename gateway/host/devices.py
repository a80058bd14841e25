"""`gateway devices`: what this host has, what the installed engines can use, and the plan."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.host.functional_check import CheckCache, fingerprint, run_isolated
from gateway.host.hardware import EP_MATRIX, HostCapabilities, probe_host, vulkan_visible_env
from gateway.host.selection import Plan, Preference, SelectionError, plan
from gateway.models.pool import describe, engine_config, fingerprint_parts, ladder, ladder_verdict
from gateway.models.registry import RegistryError, load_registry
from gateway.settings import Settings
from gateway.settings_flags import add_setting_options, given_settings


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n else "-"


def _table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def memory_verdict(spec: Any, cand: Any, config: Any, host: HostCapabilities, budgets: dict[str, int]) -> str:
    """What the candidate would take and whether it fits its budgets: "" when it cannot be estimated."""
    from gateway.models.memory import fit_config, gguf_info
    from gateway.models.pool import device_of

    info = gguf_info(config.model_path) if cand.runtime == "llamacpp" else None
    if info is None or "cpu" not in budgets:
        return ""
    need, changed, exceeded = fit_config(info, config, device_of(cand, host), budgets)
    if exceeded:
        return f"DOES NOT FIT: needs {need.describe()}; budget {exceeded}"
    return f"needs {need.describe()}" + (f"; sized down to fit: {changed}" if changed else "")


def render(host: HostCapabilities, plans: dict[str, Plan | str], checks: dict[str, Any],
           memory: dict[str, str] | None = None, budgets: dict[str, int] | None = None) -> str:
    c = host.cpu
    lines = [
        f"Host      {host.os}, {c.arch}",
        f"CPU       {c.model or '?'}: {c.physical_cores} cores ({c.logical_cores} threads), "
        f"{_gib(c.memory_bytes)}, SIMD {' '.join(c.simd) or '-'}",
    ]
    vk = host.vulkan
    head = f"Vulkan    loader {vk.loader} (API {vk.loader_api_version or '?'})" if vk.loader else "Vulkan    no loader"
    lines.append(head + ("" if vk.devices else f": {vk.reason}"))
    if vk.devices:
        rows = [("#", "NAME", "TYPE", "API", "DRIVER", "VENDOR:DEVICE", "LOCAL MEM", "MAX WORKGROUP", "INVOC", "SHARED", "SUBGROUP")]
        for d in vk.devices:
            rows.append((
                str(d.index), d.name, d.type, d.api_version, f"{d.driver_name} {d.driver_info}".strip() or str(d.driver_version),
                f"{d.vendor} {d.vendor_id:#06x}:{d.device_id:#06x}", _gib(d.device_local_bytes),
                "x".join(map(str, d.max_compute_workgroup_size)), str(d.max_compute_workgroup_invocations),
                f"{d.max_compute_shared_memory_bytes // 1024} KiB", str(d.subgroup_size or "-"),
            ))
        lines += _table(rows)
    for drv in vk.drivers:
        lines.append(f"  driver {drv.library or drv.manifest}: {'ok' if drv.ok else drv.error}")
    cu = host.cuda
    if cu.devices:
        lines.append(f"CUDA      driver {cu.driver_version or '?'}, CUDA {cu.cuda_version or '?'}"
                     + (f", CUDA_VISIBLE_DEVICES={cu.visible_devices}" if cu.visible_devices is not None else ""))
        lines += _table([("#", "NAME", "MEMORY", "COMPUTE")] + [
            (str(d.index), d.name, _gib(d.memory_bytes), d.compute_capability) for d in cu.devices
        ])
    else:
        lines.append(f"CUDA      {cu.error}")
    for name, rt in (("Metal", host.metal), ("DirectML", host.directml), ("CoreML", host.coreml)):
        lines.append(f"{name:<9} {'available: ' + rt.detail if rt.available else rt.reason}")
    et, et_vk = host.executorch, host.executorch_vulkan
    lines.append(f"ExecuTorch {'available: ' + et.detail if et.available else et.reason}")
    if et.available:
        lines.append(f"  Vulkan   {'available: ' + et_vk.detail if et_vk.available else et_vk.reason}")
    b = host.llamacpp
    if b.installed:
        lines.append(f"llama.cpp llama-cpp-python {b.version}, backends: {', '.join(b.backends) or '-'}")
        lines += [f"  {name:<9} {desc} ({kind})" for name, desc, kind in b.devices]
        if b.cpu_variants:
            lines.append(f"  {cpu_variants_line(b)}")
        if b.error:
            lines.append(f"  {b.error}")
    else:
        lines.append(f"llama.cpp {b.error}")
    for sb in host.llamacpp_builds:
        state = f"backends: {', '.join(sb.backends) or '-'}" if sb.installed else (sb.error or "unusable")
        lines.append(f"  side-by-side build {sb.lib_path}: {state}")
        if sb.installed and sb.cpu_variants:
            lines.append(f"    {cpu_variants_line(sb)}")
    if budgets:
        lines.append("Memory    budgets for models: " + ", ".join(
            f"{'RAM' if d == 'cpu' else d} {_gib(b)}" for d, b in budgets.items())
            + " (--memory-budget, --gpu-memory-budget, --memory-reserve)")
    o = host.ort
    pk = ", ".join(f"{p} {v}" for p, v in o.packages) or "none"
    lines.append(f"ONNX Runtime packages: {pk}" + (f" ({o.error})" if o.error and o.packages else ""))
    eps = [("", "EXECUTION PROVIDER", "OS", "GPU", "PACKAGE")]
    eps += [("[x]" if ep in o.providers else "[ ]", ep, os_, gpu, pkg) for ep, os_, gpu, pkg in EP_MATRIX]
    lines += _table(eps)
    for model_id, p in plans.items():
        lines.append(f"Plan for {model_id}:")
        if isinstance(p, str):
            lines.append(f"  none: {p}")
            continue
        for i, cand in enumerate(p.candidates, 1):
            check = checks.get(f"{model_id}|{cand.label}|{cand.device_key}")
            state = "not checked yet" if check is None else ("check ok" if check["ok"] else f"check FAILED: {check['reason']}")
            if check is not None and check.get("tok_s"):
                state += f", {check['tok_s']:.0f} tok/s measured"
            build = f" (build {cand.lib_path})" if cand.lib_path else ""
            lines.append(f"  {i}. {cand.label} on {cand.device}{f' [{cand.device_key}]' if cand.device_key else ''}{build}: {state}")
            steps = (check or {}).get("ladder", [])
            if len(steps) > 1:  # it fell back inside its build: each rung tried, in order
                lines[-1] += f", after {len(steps) - 1} fallback(s) inside its build:"
                lines += [f"       {s['how']}: {'ok' if s['ok'] else s['reason']}" for s in steps]
            mem = (memory or {}).get(f"{model_id}|{cand.label}|{cand.device_key}")
            if mem:
                lines.append(f"       memory: {mem}")
        for s in p.skipped:
            lines.append(f"  - {s.what}: {s.why}" + (" (fallback)" if s.kind == "unusable" else ""))
    return "\n".join(lines)


def _without_ladder(check: dict[str, Any] | None) -> dict[str, Any] | None:
    """A check as JSON: the verdict (its reason names the rungs that failed before it)."""
    return None if check is None else {k: v for k, v in check.items() if k != "ladder"}


def cpu_variants_line(b: Any) -> str:
    """The build's CPU variants: which runs by default, which this CPU cannot run."""
    from engines.llamacpp.ggml_backends import AMX_VARIANTS

    parts = []
    for name, score in b.cpu_variants:
        if score <= 0:
            continue
        tag = " (loaded by default)" if name == b.cpu_variant else (" (AMX: only when asked for)" if name in AMX_VARIANTS else "")
        parts.append(name + tag)
    unsupported = [n for n, sc in b.cpu_variants if sc <= 0]
    return ("CPU variants: " + ", ".join(parts)
            + (f"; this CPU cannot run: {', '.join(unsupported)}" if unsupported else ""))


def _devices(args: argparse.Namespace) -> int:
    settings = Settings.from_env(**given_settings(args, Settings))
    try:
        registry = load_registry(settings.config)
    except RegistryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    host = probe_host()
    cache = CheckCache(Path(registry.cache_dir) / "functional-checks.json")
    if args.recheck:
        cache.clear()
    ids = [args.model] if args.model else [registry.default or next(iter(registry.models))]
    pref = Preference(settings.engine, settings.runtime, settings.device)
    plans: dict[str, Plan | str] = {}
    checks: dict[str, Any] = {}
    memory: dict[str, str] = {}
    from gateway.models.pool import memory_budgets

    budgets = memory_budgets(host, settings)
    for mid in ids:
        spec = registry.get(mid)
        if spec is None:
            print(f"error: unknown model {mid!r}", file=sys.stderr)
            return 2
        try:
            p = plan(spec, host, pref, registry.formats(spec))
        except SelectionError as exc:
            plans[mid] = str(exc)
            continue
        plans[mid] = p
        for cand in p.candidates:
            path = registry.local_path(spec, cand.format)
            if path is None:
                continue
            verdict_mem = memory_verdict(spec, cand, engine_config(spec, cand, str(path), settings), host, budgets)
            if verdict_mem:
                memory[f"{mid}|{cand.label}|{cand.device_key}"] = verdict_mem
            # The fallback ladder: each way to run the candidate, in order, until one passes.
            rungs = []
            for config in ladder(cand, engine_config(spec, cand, str(path), settings), host, settings):
                key = fingerprint(cand.runtime, config, *fingerprint_parts(host, cand))
                result = cache.get(key)
                if result is None and (args.check or args.recheck):
                    env = {**vulkan_visible_env(host.vulkan), **({"LLAMA_CPP_LIB_PATH": cand.lib_path} if cand.lib_path else {})}
                    result = run_isolated(cand.runtime, config, settings.check_timeout, env)
                    cache.put(key, result, f"{mid} on {describe(cand, config)}")
                rungs.append((config, result))
                if result is None or result.ok:
                    break
            verdict = ladder_verdict(cand, rungs)
            if verdict is not None:
                checks[f"{mid}|{cand.label}|{cand.device_key}"] = {
                    "ok": verdict.ok, "reason": verdict.reason, "tok_s": verdict.tok_s,
                    "ladder": [{"how": describe(cand, c), "ok": r.ok, "reason": r.reason}
                               for c, r in rungs if r is not None]}
    if args.json:
        out = {
            "host": host.to_dict(),
            "ep_matrix": [
                {"provider": ep, "os": os_, "gpu": gpu, "package": pkg, "available": ep in host.ort.providers}
                for ep, os_, gpu, pkg in EP_MATRIX
            ],
            "memory_budgets": budgets,
            "plans": {
                mid: ({"error": p} if isinstance(p, str) else {
                    "candidates": [
                        {"runtime": c.runtime, "engine": c.backend, "device": c.device, "device_key": c.device_key,
                         "check": _without_ladder(checks.get(f"{mid}|{c.label}|{c.device_key}")),
                         "memory": memory.get(f"{mid}|{c.label}|{c.device_key}")}
                        for c in p.candidates
                    ],
                    "skipped": [{"what": s.what, "why": s.why, "kind": s.kind} for s in p.skipped],
                })
                for mid, p in plans.items()
            },
        }
        print(json.dumps(out, indent=2))
    else:
        print(render(host, plans, checks, memory, budgets))
    return 0 if all(not isinstance(p, str) for p in plans.values()) else 1


def add_parser(sub: Any) -> None:
    d = sub.add_parser("devices", help="show the host's devices, engine builds and the selection plan")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.add_argument("--model", help="plan for this model (default: models.yaml's default)")
    add_setting_options(d, Settings, ("engine", "runtime", "device", "config", "memory_budget", "gpu_memory_budget"))
    d.add_argument("--check", action="store_true", help="run the functional check for unchecked candidates now")
    d.add_argument("--recheck", action="store_true", help="forget cached check results and check again")
    d.set_defaults(func=_devices)
