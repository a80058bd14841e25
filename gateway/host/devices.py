"""`gateway devices`: what this host has, what the installed engines can use, and the plan."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from engines.runtimes import runtime, runtimes, text_table
from gateway.host.functional_check import CheckCache, fingerprint, run_isolated
from gateway.host.hardware import HostCapabilities, probe_host
from gateway.host.placement import Devices, decide, from_setting
from gateway.host.selection import Plan, Preference, SelectionError, plan
from gateway.models.pool import describe, engine_config, fingerprint_parts, ladder, ladder_verdict, worker_env
from gateway.models.registry import RegistryError, load_registry
from gateway.settings import Settings
from gateway.settings_flags import add_setting_options, given_settings


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n else "-"


def memory_verdict(spec: Any, cand: Any, config: Any, host: HostCapabilities, budgets: dict[str, int]) -> str:
    """What the candidate would take and whether it fits its budgets: "" when it cannot be estimated."""
    from gateway.models.memory import fit_config, gguf_info
    from gateway.models.pool import device_of

    rt = runtime(cand.runtime)
    info = gguf_info(config.model_path) if rt is not None and rt.memory_estimate else None
    if info is None or "cpu" not in budgets:
        return ""
    need, changed, exceeded = fit_config(info, config, device_of(cand, host), budgets)
    if exceeded:
        return f"DOES NOT FIT: needs {need.describe()}; budget {exceeded}"
    return f"needs {need.describe()}" + (f"; sized down to fit: {changed}" if changed else "")


def placement_of(spec: Any, p: Plan, memory: dict[str, str], host: HostCapabilities, budgets: dict[str, int],
                 devices: Devices) -> str:
    """How the plan's first candidate would use several GPUs ("" on one device): its memory verdict
    says whether one GPU holds the model (gateway/host/placement.py decides)."""
    from gateway.models.pool import device_of

    first = p.candidates[0] if p.candidates else None
    rt = runtime(first.runtime) if first is not None else None
    if first is None or first.device_index is None or rt is None or not rt.memory_estimate:
        return ""
    fits = not memory.get(f"{spec.id}|{first.label}|{first.device_key}", "").startswith("DOES NOT FIT")
    key_of = {c: device_of(c, host) for c in p.candidates if c.device_index is not None}
    if "split_devices" not in rt.options.model_fields:
        fits = True  # no split: replicas or one device
    return decide(first, p.candidates, devices, spec.placement, fits, budgets, key_of).describe(key_of)


def runtime_facts(host: HostCapabilities) -> dict[str, Any]:
    """What the runtimes add to `gateway devices --json` beside the host (ORT's ep_matrix, …)."""
    return {k: v for rt in runtimes() for k, v in rt.report_json(host).items()}


def runtime_reports(host: HostCapabilities) -> dict[str, list[str]]:
    """Each runtime's lines of `gateway devices`, by runtime name, in the runtimes' order."""
    return {rt.name: rt.report(host) for rt in runtimes()}


def render(host: HostCapabilities, plans: dict[str, Plan | str], checks: dict[str, Any],
           memory: dict[str, str] | None = None, budgets: dict[str, int] | None = None,
           placements: dict[str, str] | None = None) -> str:
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
        lines += text_table(rows)
    for drv in vk.drivers:
        lines.append(f"  driver {drv.library or drv.manifest}: {'ok' if drv.ok else drv.error}")
    cu = host.cuda
    if cu.devices:
        lines.append(f"CUDA      driver {cu.driver_version or '?'}, CUDA {cu.cuda_version or '?'}"
                     + (f", CUDA_VISIBLE_DEVICES={cu.visible_devices}" if cu.visible_devices is not None else ""))
        lines += text_table([("#", "NAME", "MEMORY", "COMPUTE")] + [
            (str(d.index), d.name, _gib(d.memory_bytes), d.compute_capability) for d in cu.devices
        ])
    else:
        lines.append(f"CUDA      {cu.error}")
    lines.append(f"{'Metal':<9} {'available: ' + host.metal.detail if host.metal.available else host.metal.reason}")
    for report in runtime_reports(host).values():
        lines += report
    if budgets:
        lines.append("Memory    budgets for models: " + ", ".join(
            f"{'RAM' if d == 'cpu' else d} {_gib(b)}" for d, b in budgets.items())
            + " (--memory-budget, --gpu-memory-budget, --memory-reserve)")
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
        where = (placements or {}).get(model_id)
        if where:
            lines.append(f"  placement: {where}")
        for s in p.skipped:
            lines.append(f"  - {s.what}: {s.why}" + (" (fallback)" if s.kind == "unusable" else ""))
    return "\n".join(lines)


def _without_ladder(check: dict[str, Any] | None) -> dict[str, Any] | None:
    """A check as JSON: the verdict (its reason names the rungs that failed before it)."""
    return None if check is None else {k: v for k, v in check.items() if k != "ladder"}


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
    pref = Preference(settings.engine, settings.runtime, from_setting(settings.device)[0])
    plans: dict[str, Plan | str] = {}
    checks: dict[str, Any] = {}
    memory: dict[str, str] = {}
    placements: dict[str, str] = {}
    one, several = from_setting(settings.device)
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
                    result = run_isolated(cand.runtime, config, settings.check_timeout, worker_env(host, cand))
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
        devices = several if several is not None else (None if one is not None else spec.devices)
        placements[mid] = placement_of(spec, p, memory, host, budgets, devices)
    if args.json:
        out = {
            "host": host.to_dict(),
            **runtime_facts(host),
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
                    "placement": placements.get(mid) or None,
                })
                for mid, p in plans.items()
            },
        }
        print(json.dumps(out, indent=2))
    else:
        print(render(host, plans, checks, memory, budgets, placements))
    return 0 if all(not isinstance(p, str) for p in plans.values()) else 1


def add_parser(sub: Any) -> None:
    d = sub.add_parser("devices", help="show the host's devices, engine builds and the selection plan")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.add_argument("--model", help="plan for this model (default: models.yaml's default)")
    add_setting_options(d, Settings, ("engine", "runtime", "device", "config", "memory_budget", "gpu_memory_budget"))
    d.add_argument("--check", action="store_true", help="run the functional check for unchecked candidates now")
    d.add_argument("--recheck", action="store_true", help="forget cached check results and check again")
    d.set_defaults(func=_devices)
