"""Resident models: loaded on first use, at most N kept (least recently used unloaded first)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.base import (
    Engine,
    EngineConfig,
    EngineError,
    EngineInfo,
    LoadInterrupted,
    ModelLoadError,
    ModelNotAvailable,
    ModelTooLarge,
    NoRoom,
    Supervised,
)
from engines.registry import create_engine
from engines.runtimes import Runtime, in_one_process, option_values, runtime
from engines.worker.client import WorkerEngine
from engines.worker.connections import LocalWorker, RemoteWorker, Supervision
from gateway.host.functional_check import (
    CheckCache,
    CheckResult,
    exercise,
    fingerprint,
    measure_decode,
    one_token,
)
from gateway.host.hardware import HostCapabilities, probe_host, vulkan_visible_env
from gateway.host.placement import Devices, Split, chosen, decide, from_setting, replicas_of
from gateway.host.selection import Candidate, Plan, Preference, SelectionError, plan
from gateway.metrics import Metrics
from gateway.models.gguf_info import GGUFInfo
from gateway.models.memory import MiB, Need, default_reserve, fit_config, gguf_info
from gateway.models.registry import ModelSpec, ModelUnavailable, Registry
from gateway.models.routing import WorkerGroup
from gateway.settings import Settings

log = logging.getLogger(__name__)

EngineFactory = Callable[[str, EngineConfig], Engine]
# (runtime, config) -> CheckResult, run before an engine is trusted (in a child process by default).
Checker = Callable[[str, EngineConfig], CheckResult]
# On a cluster: the engine that serves a model from elsewhere (its Ray Serve deployment), or None
# for a model this process serves itself.
ClusterEngines = Callable[[ModelSpec, Metrics], Engine | None]


class ModelBusy(Exception):
    """The model has requests running or waiting, so it cannot be unloaded now."""


@dataclass
class Loaded:
    spec: ModelSpec
    engine: Engine
    candidate: Candidate
    load_seconds: float
    last_used: float
    fallback_reason: str = ""  # why earlier candidates were not used; "" when the first one was
    plan: Plan | None = None
    check_key: str = ""  # its functional-check cache entry
    config: EngineConfig | None = None  # how it runs (its rung of the fallback ladder)
    need: Need | None = None  # its estimated memory (None: not estimated, e.g. not a GGUF)
    fitted: str = ""  # what was sized down to fit the memory budget ("" when nothing)
    keep_alive: float | None = None  # set by a request (Ollama's keep_alive); else the model's default
    over_estimate: bool = False  # its worker was measured over the estimate (logged and counted once)

    @property
    def placement(self) -> str:
        """How it uses several GPUs ("" on one device): "replicas on cuda:0, cuda:1" or "split over
        cuda:0 (0.5), cuda:1 (0.5)"."""
        n = self.need
        if n is not None and n.shares:
            return "split over " + ", ".join(f"{d} ({s:g})" for d, s in n.shares.items())
        if n is not None and n.copies:
            return "replicas on " + ", ".join(n.copies)
        return ""


# A worker measured this much over its estimate is logged and counted (gateway_memory_estimate_misses).
ESTIMATE_SLACK = 0.15


def memory_budgets(host: HostCapabilities, settings: Settings) -> dict[str, int]:
    """Bytes models may take per device: "cpu" (RAM) and each GPU ("cuda:0", "vulkan:1")."""
    out: dict[str, int] = {}
    total = host.cpu.memory_bytes
    if settings.memory_budget is not None:
        out["cpu"] = settings.memory_budget
    elif total:
        out["cpu"] = total - (settings.memory_reserve if settings.memory_reserve is not None else default_reserve(total))
    gpus = [(f"cuda:{d.index}", d.memory_bytes) for d in host.cuda.devices]
    gpus += [(f"vulkan:{d.index}", d.device_local_bytes) for d in host.vulkan.devices if d.type != "cpu"]
    for key, size in gpus:
        if settings.gpu_memory_budget is not None:
            out[key] = settings.gpu_memory_budget
        elif size:
            out[key] = size - (settings.memory_reserve if settings.memory_reserve is not None else
                               min(max(512 * MiB, size // 20), size // 2))
    return out


def device_of(cand: Candidate, host: HostCapabilities) -> str:
    """The budget a candidate draws on: "cpu" for the CPU (and a software Vulkan device), else its GPU's."""
    if cand.backend in ("cuda", "vulkan") and cand.device_index is not None:
        if cand.backend == "vulkan":
            dev = next((d for d in host.vulkan.devices if d.index == cand.device_index), None)
            if dev is not None and dev.type == "cpu":
                return "cpu"
        return f"{cand.backend}:{cand.device_index}"
    return "cpu"


class ModelManager:
    """Owns every loaded engine.  Safe to call from many requests at once.

    For each model it plans candidates from the host probe, and for each candidate in turn
    runs the functional check (cached), loads the engine and generates one token; the first
    that works serves, and why the others did not is kept for headers, /health and the log.
    """

    def __init__(
        self,
        registry: Registry,
        settings: Settings,
        factory: EngineFactory | None = None,
        metrics: Metrics | None = None,
        host: HostCapabilities | None = None,
        checker: Checker | None = None,
        cluster: ClusterEngines | None = None,
    ) -> None:
        self.registry = registry
        self._cluster = cluster
        self.settings = settings
        # None: engines run in supervised worker processes (settings.workers) or, with that off, in
        # this process. Tests inject a factory of fake engines.
        self._factory = factory
        self.metrics = metrics or Metrics()
        self.host = host if host is not None else probe_host()
        if not settings.workers:
            self.host = in_one_process(self.host)
        self._checker = checker
        self.checks = CheckCache(Path(registry.cache_dir) / "functional-checks.json")
        self.on_loaded: list[Callable[[Loaded], None]] = []  # called as each load completes
        self._loaded: OrderedDict[str, Loaded] = OrderedDict()
        self._locks: dict[str, asyncio.Lock] = {}
        self.loading: set[str] = set()
        self.load_errors: dict[str, str] = {}
        self.attempts: dict[str, list[tuple[str, str]]] = {}  # model -> [(candidate, why it failed)]
        one, self._devices = from_setting(settings.device)
        self.preference = Preference(settings.engine, settings.runtime, one)
        self.env = vulkan_visible_env(self.host.vulkan)
        # ggml reads this when its Vulkan backend starts, i.e. before the first model loads.
        os.environ.update(self.env)
        # model id -> (runtime, backend) -> why that engine is out of selection (parity drift).
        self.excluded: dict[str, dict[tuple[str, str], str]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self.speeds: dict[str, dict[str, float]] = {}  # model -> engine label -> measured tok/s
        self.budgets = memory_budgets(self.host, settings)
        self._reserved: dict[str, Need] = {}  # loads under way: the memory they will take
        self._reaper: asyncio.Task[None] | None = None
        self.reap_interval = 1.0  # seconds between keep_alive checks
        self.pulls: dict[str, Any] = {}  # Hub pulls in progress (name -> hub.PullProgress), for the web page
        from gateway.models.pulls import Pulls

        self.pull_jobs = Pulls(self)

    def is_loaded(self, model_id: str) -> bool:
        return model_id in self._loaded

    def loaded(self) -> list[Loaded]:
        return list(self._loaded.values())

    def entry(self, model_id: str) -> Loaded | None:
        """The model's engine if it is loaded now."""
        return self._loaded.get(model_id)

    def available(self, spec: ModelSpec) -> bool:
        """Its files are on this machine (no download needed)."""
        return any(self.registry.local_path(spec, f) is not None for f in spec.formats)

    def loadable(self, spec: ModelSpec) -> bool:
        """A request could load `spec` now: it is served elsewhere (remote workers, a cluster's
        replicas), its files are here, or they come from the Hugging Face hub on first use. Says
        nothing of a load that failed (load_errors)."""
        if spec.workers or self._cluster is not None:
            return True
        return self.available(spec) or any(src.hf is not None for src in spec.formats.values())

    def plan(self, spec: ModelSpec) -> Plan:
        return plan(spec, self.host, self.preference, self.registry.formats(spec))

    async def get(self, spec: ModelSpec) -> Loaded:
        entry = self._loaded.get(spec.id)
        if entry is None:
            lock = self._locks.setdefault(spec.id, asyncio.Lock())
            async with lock:
                entry = self._loaded.get(spec.id)
                if entry is None:
                    entry = await self._load(spec)
                    for hook in self.on_loaded:
                        hook(entry)
        self._loaded.move_to_end(spec.id)
        entry.last_used = time.monotonic()
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap())
        return entry

    # --- memory and keep_alive ----------------------------------------------------------

    def held(self, entry: Loaded, device: str) -> int:
        """Bytes `entry` holds on `device`: its estimate, or its worker's measured resident memory
        when that is more (the host prefix cache fills it as conversations lose their slots)."""
        est = entry.need.on(device) if entry.need is not None else 0
        if device == "cpu":
            if isinstance(entry.engine, Supervised):
                try:
                    rss = entry.engine.report().rss_bytes
                except Exception:  # noqa: BLE001 - a worker between restarts has no numbers
                    rss = 0
                if entry.need is not None and rss > est * (1 + ESTIMATE_SLACK) and not entry.over_estimate:
                    entry.over_estimate = True
                    self.metrics.memory_misses.labels(entry.spec.id).inc()
                    log.warning("%s: its worker holds %.0f MiB, %.0f%% over the estimate of %.0f MiB (%s); the "
                                "memory budget counts the measured size", entry.spec.id, rss / MiB,
                                100 * (rss / est - 1), est / MiB, entry.need.describe())
                est = max(est, rss)
        return est

    def used(self, device: str) -> int:
        """Bytes held on `device` by the loaded models and the loads under way (their estimates)."""
        return sum(self.held(e, device) for e in self._loaded.values()) + sum(n.on(device) for n in self._reserved.values())

    def memory_status(self) -> dict[str, Any]:
        """Budgets and what the loaded models hold, per device (for /health and the web page)."""
        return {d: {"budget_bytes": b, "used_bytes": self.used(d)} for d, b in self.budgets.items()}

    def _fit(self, spec: ModelSpec, cand: Candidate, config: EngineConfig,
             candidates: tuple[Candidate, ...] = ()) -> tuple[EngineConfig, Need | None, str]:
        """`config` sized down (fewer sequences, then a shorter context) where the model would not
        fit its device's budget, or split over the model's GPUs (`placement`); ModelTooLarge when it
        cannot fit even then."""
        rt = runtime(cand.runtime)
        if rt is None or not rt.memory_estimate:
            return config, None, ""
        info = gguf_info(config.model_path)
        if info is None or "cpu" not in self.budgets:
            return config, None, ""
        device = device_of(cand, self.host)
        alone: tuple[EngineConfig, Need | None, str] | None = None
        too_large: ModelTooLarge | None = None
        if spec.placement != "split":
            try:
                alone = self._fit_on(spec, rt, info, config, None, device)
            except ModelTooLarge as exc:
                too_large = exc
        if "split_devices" in rt.options.model_fields:
            key_of = {c: device_of(c, self.host) for c in candidates if c.device_index is not None}
            where = decide(cand, candidates, self.devices_of(spec), spec.placement, too_large is None, self.budgets,
                           key_of)
            if where.split is not None:
                if too_large is not None:
                    log.info("%s does not fit one GPU (%s): %s", spec.id, too_large, where.describe(key_of))
                return self._fit_on(spec, rt, info, config, where.split)
        if too_large is not None:
            raise too_large
        return alone if alone is not None else self._fit_on(spec, rt, info, config, None, device)

    def _fit_on(self, spec: ModelSpec, rt: Runtime, info: GGUFInfo, config: EngineConfig, split: Split | None,
                device: str = "") -> tuple[EngineConfig, Need | None, str]:
        budgets = self.budgets
        if split is not None:  # the GPUs as one budget, each holding its share
            device, budgets = split.key, {**budgets, split.key: split.room(budgets)}
        # The host prefix cache is part of the estimate and of the RAM budget: by default what the
        # budget has left beside this model and the others, so it never takes memory another holds.
        need, changed, exceeded = fit_config(info, config, device, budgets, self.used("cpu"))
        if exceeded:
            raise ModelTooLarge(
                f"model {spec.id!r} needs {need.describe()} even with one sequence and a {need.context}-token "
                f"context; the budget is {exceeded} (--memory-budget, --gpu-memory-budget, --memory-reserve)")
        if changed:
            log.warning("%s sized down to fit the memory budget of %s: %s (needs %s)", spec.id, device, changed,
                        need.describe())
            config = dataclasses.replace(config, parallel=need.parallel, context_length=need.context)
        # The host cache the estimate sized, where the runtime's options have one (llama.cpp's).
        values = option_values(config) or dict(rt.load_options({}).model_dump(mode="json"))
        if "prefix_cache_mib" in values:
            values["prefix_cache_mib"] = need.parts["host cache"] // MiB
        if split is not None:
            need = dataclasses.replace(need, shares=dict(zip(split.keys, split.shares, strict=True)))
            values.update(split_devices=[c.device_key for c in split.members[1:]], tensor_split=list(split.shares))
        if "prefix_cache_mib" in values or split is not None:
            config = dataclasses.replace(config, options=rt.load_options(values))
        return config, need, changed

    def keep_alive_of(self, entry: Loaded) -> float:
        """Seconds `entry` stays loaded once idle (negative: until evicted)."""
        if entry.keep_alive is not None:
            return entry.keep_alive
        if entry.spec.keep_alive is not None:
            return entry.spec.keep_alive
        if self.settings.keep_default and entry.spec.id == self.registry.default:
            return -1.0
        return self.settings.keep_alive

    def set_keep_alive(self, model_id: str, seconds: float | None) -> None:
        """A request's keep_alive for `model_id` (None: the model's default again), counted from now."""
        entry = self._loaded.get(model_id)
        if entry is not None:
            entry.keep_alive = seconds
            entry.last_used = time.monotonic()

    def expires(self, entry: Loaded) -> float | None:
        """The unix time `entry` is unloaded at if no request comes (None: it is not)."""
        keep = self.keep_alive_of(entry)
        if keep < 0:
            return None
        return time.time() + max(0.0, entry.last_used + keep - time.monotonic())

    async def _reap(self) -> None:
        """Unload models idle for longer than their keep_alive."""
        while True:
            await asyncio.sleep(self.reap_interval)
            now = time.monotonic()
            for mid, entry in list(self._loaded.items()):
                if entry.candidate.format in ("ray", "remote") or mid in self.loading:
                    continue
                self.held(entry, "cpu")  # measured against the estimate as its caches fill
                if not _idle(entry.engine):
                    entry.last_used = now
                    continue
                keep = self.keep_alive_of(entry)
                if keep < 0 or now - entry.last_used < keep:
                    continue
                try:
                    if await self.unload(mid):
                        log.info("unloaded %s: idle for %.0f s (keep_alive %s s)", mid, now - entry.last_used, keep)
                except ModelBusy:
                    pass

    async def _load(self, spec: ModelSpec) -> Loaded:
        self.loading.add(spec.id)
        failures: list[tuple[str, str]] = []
        too_large: list[ModelTooLarge] = []
        self.attempts[spec.id] = failures
        try:
            if spec.workers:
                return await self._load_remote(spec)
            remote = self._cluster(spec, self.metrics) if self._cluster is not None else None
            if remote is not None:
                return await self._load_cluster(spec, remote)
            try:
                the_plan = self.plan(spec)
            except SelectionError as exc:
                raise ModelLoadError(str(exc)) from exc
            excluded = self.excluded.get(spec.id, {})
            kept = tuple(c for c in the_plan.candidates if (c.runtime, c.backend) not in excluded
                         and chosen(c, self.devices_of(spec)))
            if not kept:
                raise ModelLoadError(
                    f"every engine for model {spec.id!r} is excluded: "
                    + "; ".join(f"{r}/{b}: {why}" for (r, b), why in excluded.items())
                )
            the_plan = dataclasses.replace(the_plan, candidates=kept)
            if self.settings.rank_by_speed:
                the_plan = dataclasses.replace(the_plan, candidates=await self._rank_by_speed(spec, kept))
            for ci, cand in enumerate(the_plan.candidates):
                try:
                    path = await asyncio.to_thread(self._resolve, spec, cand.format)
                except ModelUnavailable as exc:
                    raise ModelNotAvailable(str(exc)) from exc
                try:
                    base, need, fitted = self._fit(spec, cand, self._config(spec, cand, str(path)),
                                                   the_plan.candidates)
                except ModelTooLarge as exc:
                    failures.append((f"{cand.label} on {cand.device}", str(exc)))
                    too_large.append(exc)
                    log.warning("%s cannot run on %s: %s", spec.id, cand.device, exc)
                    continue
                rungs = ladder(cand, base, self.host, self.settings)
                for ri, config in enumerate(rungs):
                    # The ladder inside one build first (repacking off, then a lower CPU variant),
                    # then the next candidate; the last rung of the last candidate never gives up.
                    last = ci == len(the_plan.candidates) - 1 and ri == len(rungs) - 1
                    t0 = time.perf_counter()
                    engine, why, stage = await self._try(spec, cand, config, last, need)
                    if engine is None:
                        failures.append((describe(cand, config), why))
                        self.metrics.fallbacks.labels(spec.id, cand.label, "check_failed").inc()
                        # A load that failed without crashing (no such device, a bad file) fails on
                        # every rung alike: straight to the next candidate.
                        more = ri < len(rungs) - 1 and stage != "load"
                        log.warning("%s on %s is not usable, trying the next %s: %s", spec.id, describe(cand, config),
                                    "way to run it" if more else "candidate", why)
                        if more:
                            continue
                        break
                    engine, need = await self._with_replicas(spec, cand, engine, need, the_plan.candidates, str(path))
                    dt = time.perf_counter() - t0
                    info = engine.info
                    self.metrics.build.labels(spec.id).info(
                        {"runtime": info.runtime, "version": info.version, "backend": info.backend, "device": info.device}
                    )
                    reasons = [f"{s.what}: {s.why}" for s in the_plan.unusable(before=cand)]
                    reasons += [f"{r}/{b}: {why}" for (r, b), why in excluded.items()]
                    reasons += [f"{what}: {why}" for what, why in failures]
                    entry = Loaded(spec, engine, cand, dt, time.monotonic(), "; ".join(reasons), the_plan,
                                   self._key(cand, config), config, need, fitted)
                    level = logging.WARNING if entry.fallback_reason else logging.INFO
                    log.log(level, "serving %s on %s, loaded in %.2fs%s", spec.id, describe(cand, config), dt,
                            f"; fell back because {entry.fallback_reason}" if entry.fallback_reason else "")
                    self._loaded[spec.id] = entry
                    self.load_errors.pop(spec.id, None)
                    return entry
            if too_large and len(too_large) == len(failures):
                raise too_large[0] if len(too_large) == 1 else ModelTooLarge("; ".join(str(e) for e in too_large))
            raise ModelLoadError(
                f"model {spec.id!r} could not be loaded: " + "; ".join(f"{w}: {y}" for w, y in failures)
            )
        except EngineError as exc:
            self.load_errors[spec.id] = str(exc)
            raise
        finally:
            self.loading.discard(spec.id)
            self._reserved.pop(spec.id, None)

    def devices_of(self, spec: ModelSpec) -> Devices:
        """The GPUs `spec` may use: the command line's (`--device` naming several; one it names is
        the plan's alone), else models.yaml's `devices`."""
        if self._devices is not None:
            return self._devices
        return None if self.preference.device is not None else spec.devices

    async def _with_replicas(self, spec: ModelSpec, cand: Candidate, engine: Engine, need: Need | None,
                             candidates: tuple[Candidate, ...], path: str) -> tuple[Engine, Need | None]:
        """`engine` and a copy on each further GPU `placement` gives the model (placement.replicas_of),
        as one engine whose requests go by load and by where their prefix is cached; a copy that
        does not fit or load is left out, said in the log."""
        rt = runtime(cand.runtime)
        info = gguf_info(path) if need is not None and not need.shares else None
        mates = replicas_of(cand, candidates, self.devices_of(spec), spec.placement) if info is not None else []
        if rt is None or info is None or need is None or not mates:
            return engine, need
        members, devices = [engine], [need.device]
        for mate in mates:
            try:
                config, mine, _ = self._fit_on(spec, rt, info, self._config(spec, mate, path), None,
                                               device_of(mate, self.host))
            except ModelTooLarge as exc:
                log.warning("%s: no replica on %s: %s", spec.id, mate.device, exc)
                continue
            at = mine.device if mine is not None else device_of(mate, self.host)
            # Room for every copy so far and this one (reserved while it loads).
            replica, why, _ = await self._try(spec, mate, config, last=False,
                                              need=dataclasses.replace(need, copies=(*devices, at)))
            if replica is None:
                log.warning("%s: no replica on %s: %s", spec.id, mate.device, why)
                continue
            members.append(replica)
            devices.append(at)
        if len(members) == 1:
            return engine, need
        log.info("%s: %d replicas, on %s", spec.id, len(members), ", ".join(devices))
        return WorkerGroup(members), dataclasses.replace(need, copies=tuple(devices))

    def _key(self, cand: Candidate, config: EngineConfig) -> str:
        return fingerprint(cand.runtime, config, *fingerprint_parts(self.host, cand))

    async def _try(self, spec: ModelSpec, cand: Candidate, config: EngineConfig,
                   last: bool = True, need: Need | None = None) -> tuple[Engine | None, str, str]:
        """Functional check (cached), load, then the check's work (one token when a pass is cached).
        (engine, "", "") or (None, why, stage); stage "load": it failed to load without crashing.
        `last`: no other way to serve the model follows this one."""
        labels = (spec.id, cand.label, cand.device)
        key = self._key(cand, config)
        what = f"{spec.id} on {describe(cand, config)}"
        cached: CheckResult | None = None
        if self.settings.functional_check:
            cached = self.checks.get(key)
            if cached is not None and not cached.ok:
                self.metrics.loads.labels(*labels, "failed").inc()
                note = cached.note or "cached functional check; re-run with --recheck"
                return None, f"{cached.reason} ({note})", cached.stage
        # Room only now that an engine is about to load: a model whose files are missing, or whose
        # every way to run is known to fail, must not unload a model that serves.
        await self._make_room(need, spec.id)
        if need is not None:
            self._reserved[spec.id] = need  # at once: a load that starts meanwhile counts it
        if self.settings.functional_check and cached is None and self._checker is not None:
            result = await asyncio.to_thread(self._checker, cand.runtime, config)
            if not result.ok:
                self.checks.put(key, result, what)
                self.metrics.loads.labels(*labels, "failed").inc()
                return None, result.reason, result.stage
            cached = result
        engine = self._new_engine(spec, cand, config, last)
        stage = "load"
        try:
            await engine.load()
            stage = ""
            if self.settings.functional_check:
                work = one_token(engine) if cached is not None else exercise(engine, config.parallel, config.context_length,
                                                                            light=config.backend != "cpu")
                await asyncio.wait_for(work, self.settings.check_timeout)
        except (EngineError, RuntimeError, TimeoutError) as exc:
            self.metrics.loads.labels(*labels, "failed").inc()
            await engine.close()
            why = str(exc) or type(exc).__name__
            if stage == "load" and "killed by" in why:
                stage = ""  # the worker crashed while loading: another rung may not
            if self.settings.functional_check and not isinstance(exc, LoadInterrupted):
                self.checks.put(key, CheckResult(False, why, stage=stage), what)
            return None, why, stage
        if isinstance(engine, Supervised):
            engine.trust()  # from now on a crash restarts the worker instead of failing the check
        self.metrics.loads.labels(*labels, "ok").inc()
        if self.settings.functional_check:
            self.checks.put(key, CheckResult(True), what)
        return engine, "", ""

    async def _rank_by_speed(self, spec: ModelSpec, candidates: tuple[Candidate, ...]) -> tuple[Candidate, ...]:
        """Candidates that share a device, fastest first (a 32-token decode each, cached with the
        functional check); devices keep the plan's order, and so does a candidate never measured."""
        groups: dict[str, list[int]] = {}
        for i, c in enumerate(candidates):
            groups.setdefault(c.device, []).append(i)
        order = list(candidates)
        for positions in groups.values():
            if len(positions) < 2:
                continue
            speeds: dict[int, float] = {}
            for i in positions:
                cand = candidates[i]
                try:
                    path = await asyncio.to_thread(self._resolve, spec, cand.format)
                except ModelUnavailable:
                    continue
                config = ladder(cand, self._config(spec, cand, str(path)), self.host, self.settings)[0]
                key = self._key(cand, config)
                cached = self.checks.get(key)
                if cached is not None and cached.ok and cached.tok_s:
                    speeds[i] = cached.tok_s
                    continue
                engine, _, _ = await self._try(spec, cand, config)
                if engine is None:
                    continue
                try:
                    speeds[i] = await measure_decode(engine)
                except (EngineError, RuntimeError) as exc:
                    log.warning("could not measure %s on %s: %s", cand.label, cand.device, exc)
                finally:
                    await engine.close()
                if i in speeds:
                    self.checks.put(key, CheckResult(True, tok_s=speeds[i]), f"{spec.id} on {describe(cand, config)}")
            self.speeds.setdefault(spec.id, {}).update({candidates[i].label: s for i, s in speeds.items()})
            ranked = sorted(positions, key=lambda i: (i not in speeds, -speeds.get(i, 0.0), i))
            for slot, i in zip(positions, ranked, strict=True):
                order[slot] = candidates[i]
            log.info("%s on %s ranked by measured decode speed: %s", spec.id, candidates[positions[0]].device,
                     ", ".join(f"{candidates[i].label} {speeds[i]:.0f} tok/s" for i in ranked if i in speeds))
        return tuple(order)

    async def _load_remote(self, spec: ModelSpec) -> Loaded:
        """Serve `spec` on its remote workers (models.yaml `workers`), as one routed engine."""
        assert spec.workers
        members: list[Engine] = []
        for w in spec.workers:
            host, port, tls = w.address
            token_path = Path(w.token_file)
            if not token_path.is_absolute():
                token_path = Path(self.registry.base_dir) / token_path
            try:
                token = token_path.read_text().strip()
            except OSError as exc:
                raise ModelLoadError(f"cannot read the token of worker {w.url}: {exc}") from exc
            context = ssl.create_default_context(cafile=w.ca_file) if tls else None
            members.append(WorkerEngine(
                RemoteWorker(host, port, token, context),
                EngineInfo("remote", "remote", w.url),
                supervision(self.settings),
                on_crash=functools.partial(self._remote_crash, spec.id, w.url),
            ))
        group = WorkerGroup(members)
        t0 = time.perf_counter()
        await self._make_room()
        await group.load()
        info = group.info
        where = ", ".join(w.url for w in spec.workers)
        cand = Candidate(info.runtime, info.backend, f"{info.device} on {where}", "", "remote")
        entry = Loaded(spec, group, cand, time.perf_counter() - t0, time.monotonic())
        self._loaded[spec.id] = entry
        self.load_errors.pop(spec.id, None)
        log.info("serving %s on %d remote worker(s): %s", spec.id, len(members), where)
        return entry

    async def _load_cluster(self, spec: ModelSpec, engine: Engine) -> Loaded:
        """Serve `spec` on its cluster deployment (the replicas own the engines; nothing is loaded here)."""
        t0 = time.perf_counter()
        await engine.load()
        info = engine.info
        cand = Candidate(info.runtime, info.backend, info.device, "", "ray")
        entry = Loaded(spec, engine, cand, time.perf_counter() - t0, time.monotonic())
        self._loaded[spec.id] = entry
        self.load_errors.pop(spec.id, None)
        log.info("serving %s on its Ray Serve deployment (%s/%s on %s)", spec.id, info.runtime, info.backend, info.device)
        return entry

    def _new_engine(self, spec: ModelSpec, cand: Candidate, config: EngineConfig, last: bool = True) -> Engine:
        if self._factory is not None:
            return self._factory(cand.runtime, config)
        labels = (spec.id, cand.label, cand.device)
        key = self._key(cand, config)
        return local_engine(cand, config, self.settings, self.host,
                            on_crash=lambda _why: self.metrics.worker_crashes.labels(*labels).inc(),
                            on_failed=lambda why: self.crashed_out(spec.id, cand, key, why),
                            can_fall_back=lambda: not last, probation=True, standby=spec.standby)

    def _resolve(self, spec: ModelSpec, fmt: str) -> Path:
        """The model's file, with its vision projector beside it (blocking: either may be downloaded)."""
        path = self.registry.resolve(spec, fmt)
        if fmt == "gguf":
            self.registry.projector(spec, fetch=True)
        return path

    def _config(self, spec: ModelSpec, cand: Candidate, path: str) -> EngineConfig:
        mmproj = self.registry.projector(spec) if cand.format == "gguf" else None
        return engine_config(spec, cand, path, self.settings, str(mmproj or ""))

    def _remote_crash(self, model_id: str, url: str, _why: str) -> None:
        self.metrics.worker_crashes.labels(model_id, "remote", url).inc()

    def crashed_out(self, model_id: str, cand: Candidate, key: str, reason: str) -> None:
        """A serving engine crashed too often: the next request walks the ladder from the next rung.

        Recorded like a failed functional check, but only for settings.crash_verdict_ttl: then that
        way of running the model is tried again (a crash verdict does not poison the cache)."""
        what = f"{model_id} on {cand.label} {cand.device}"
        self.checks.put(key, CheckResult(False, f"worker crashed: {reason}"), what, ttl=self.settings.crash_verdict_ttl)
        self.metrics.fallbacks.labels(model_id, cand.label, "worker_crashed").inc()
        log.warning("model %s: %s worker crashed too often, falling back: %s", model_id, cand.label, reason)
        entry = self._loaded.get(model_id)
        if entry is None or entry.check_key != key:
            return
        del self._loaded[model_id]
        task = asyncio.create_task(self._close_when_idle(entry.engine))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def exclude(self, model_id: str, cand: Candidate, reason: str, cause: str = "parity_drift") -> None:
        """Take `cand` out of selection for `model_id`; the next request loads the next candidate.

        `cause` labels gateway_fallbacks_total. The engine in use is unloaded once its running
        requests finish.
        """
        engine = f"{cand.runtime}/{cand.backend}"
        if (cand.runtime, cand.backend) in self.excluded.get(model_id, {}):
            return
        self.excluded.setdefault(model_id, {})[(cand.runtime, cand.backend)] = reason
        log.warning("model %s: engine %s excluded: %s", model_id, engine, reason)
        entry = self._loaded.get(model_id)
        if entry is None or entry.candidate != cand:
            return
        del self._loaded[model_id]
        self.metrics.fallbacks.labels(model_id, engine, cause).inc()
        if entry.check_key:
            # Recorded like a failed functional check: `gateway devices` shows it, and the next
            # start skips this engine too until `--recheck`.
            self.checks.put(entry.check_key, CheckResult(False, f"{cause.replace('_', ' ')}: {reason}"),
                            f"{model_id} on {cand.label} {cand.device}")
        task = asyncio.create_task(self._close_when_idle(entry.engine))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    @staticmethod
    async def _close_when_idle(engine: Engine, patience_s: float = 120.0) -> None:
        deadline = time.monotonic() + patience_s
        while not _idle(engine) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await engine.close()

    async def unload(self, model_id: str) -> bool:
        """Unload `model_id` now (False: it was not loaded). Raises ModelBusy while it has requests
        running or waiting; waits for a load in progress to end first (the model's own lock)."""
        async with self._locks.setdefault(model_id, asyncio.Lock()):
            entry = self._loaded.get(model_id)
            if entry is None:
                return False
            h = entry.engine.health()
            if h.running or h.waiting:
                raise ModelBusy(f"model {model_id!r} has {h.running + h.waiting} request(s) running or waiting")
            del self._loaded[model_id]
        log.info("unloading %s (asked to)", model_id)
        await entry.engine.close()
        return True

    async def _make_room(self, need: Need | None = None, for_model: str = "") -> None:
        """Unload least recently used idle models until `need` fits every device's budget and one
        more model is within --max-models (models served by a cluster's replicas or remote workers
        hold nothing here and do not count). Models that hold the memory but are busy are waited
        for, up to --max-queue-wait: then NoRoom."""
        deadline = time.monotonic() + self.settings.max_queue_wait
        while True:
            here = [k for k, v in self._loaded.items() if v.candidate.format not in ("ray", "remote")]
            short = [d for d in self.budgets if need is not None and need.on(d)
                     and self.used(d) + need.on(d) > self.budgets[d]]
            full = self.settings.max_resident > 0 and len(here) >= self.settings.max_resident
            if not short and not full:
                return
            victims = [k for k in here if _idle(self._loaded[k].engine)
                       and (full or any(self.held(self._loaded[k], d) for d in short))]
            if victims:
                entry = self._loaded.pop(victims[0])
                why = (f"to make room for {for_model or 'another model'} on {', '.join(short)}" if short
                       else "least recently used")
                log.info("unloading %s (%s)", victims[0], why)
                await entry.engine.close()
                continue
            if not short:
                log.warning("all %d resident models are busy; loading one more", len(here))
                return
            if time.monotonic() >= deadline:
                assert need is not None
                held = ", ".join(f"{k} {self.held(self._loaded[k], short[0]) / MiB:.0f} MiB" for k in here)
                raise NoRoom(
                    f"model {for_model!r} needs {need.on(short[0]) / MiB:.0f} MiB on {short[0]} "
                    f"(budget {self.budgets[short[0]] / MiB:.0f} MiB, {self.used(short[0]) / MiB:.0f} MiB held by "
                    f"busy models: {held}); try again when they finish")
            await asyncio.sleep(0.2)

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for task in list(self._closing):
            await task
        while self._loaded:
            _, entry = self._loaded.popitem()
            await entry.engine.close()


def supervision(settings: Settings) -> Supervision:
    s = settings
    return Supervision(heartbeat_timeout_s=s.worker_heartbeat_timeout, step_timeout_s=s.worker_step_timeout,
                       max_crashes=s.worker_max_crashes, crash_window_s=s.worker_crash_window,
                       load_timeout_s=s.check_timeout, max_backoff_s=s.worker_max_backoff)


def ladder(cand: Candidate, config: EngineConfig, host: HostCapabilities, settings: Settings) -> list[EngineConfig]:
    """The ways to run `cand`, tried in order before the next candidate (its runtime's fallback
    ladder: llama.cpp's turns repacking off, then takes a lower CPU variant)."""
    rt = runtime(cand.runtime)
    return [config] if rt is None else rt.ladder(config, host, cand.lib_path)


def cached_ladder(checks: CheckCache, cand: Candidate, config: EngineConfig, host: HostCapabilities,
                  settings: Settings) -> list[tuple[EngineConfig, CheckResult | None]]:
    """Each rung of `cand`'s ladder with its cached functional check (None: not checked)."""
    return [(c, checks.get(fingerprint(cand.runtime, c, *fingerprint_parts(host, cand))))
            for c in ladder(cand, config, host, settings)]


def ladder_verdict(cand: Candidate, rungs: list[tuple[EngineConfig, CheckResult | None]]) -> CheckResult | None:
    """A candidate's cached verdict: the first rung that passed (naming the rungs that failed before
    it), else the last failure; None when no rung was checked."""
    failed: list[str] = []
    last: CheckResult | None = None
    for config, result in rungs:
        if result is None:
            return last if last is None else dataclasses.replace(last, reason="; ".join(failed))
        if result.ok:
            if failed:
                return dataclasses.replace(result, reason=f"runs with {rung(cand, config)} after: " + "; ".join(failed))
            return result
        failed.append(f"{describe(cand, config)}: {result.reason}")
        last = result
    return None if last is None else dataclasses.replace(last, reason="; ".join(failed))


def describe(cand: Candidate, config: EngineConfig) -> str:
    """A candidate and its rung, for reasons and logs: "llamacpp/cpu on cpu (CPU variant zen4, repack off)"."""
    where = f"{cand.label} on {cand.device}"
    how = rung(cand, config)
    return f"{where} ({how})" if how else where


def rung(cand: Candidate, config: EngineConfig) -> str:
    """The rung of its runtime's ladder `config` is ("" where the runtime has one way to run)."""
    rt = runtime(cand.runtime)
    return rt.rung(config) if rt is not None else ""


def worker_env(host: HostCapabilities, cand: Candidate) -> dict[str, str]:
    """The environment of a worker serving `cand`: Vulkan device visibility, and its runtime build."""
    env = vulkan_visible_env(host.vulkan)
    rt = runtime(cand.runtime)
    if rt is not None:
        env.update(rt.build_env(cand.lib_path))
    return env


def local_engine(cand: Candidate, config: EngineConfig, settings: Settings, host: HostCapabilities,
                 on_crash: Callable[[str], None] | None = None,
                 on_failed: Callable[[str], None] | None = None,
                 can_fall_back: Callable[[], bool] | None = None, probation: bool = False,
                 standby: bool = False) -> Engine:
    """`cand` with `config`: in a supervised worker process (settings.workers), else in this process
    (with `standby`, a second worker loaded and waiting to take over when the first dies)."""
    if not settings.workers:
        return create_engine(cand.runtime, config)
    return WorkerEngine(
        LocalWorker(cand.runtime, config, env=worker_env(host, cand), plugins=(*settings.plugins, *settings.worker_plugins),
                    log_level=settings.log_level, load_timeout_s=settings.check_timeout, standby=standby),
        EngineInfo(cand.runtime, cand.backend, cand.device, context_length=config.context_length,
                   parallel=config.parallel),
        supervision(settings), on_crash=on_crash, on_failed=on_failed, can_fall_back=can_fall_back,
        probation=probation,
    )


def configured_parallel(spec: ModelSpec, settings: Settings) -> int:
    """The sequences `spec` is served with: --parallel over models.yaml over the default."""
    return settings.parallel or spec.parallel or 4


def kv_sharing(spec: ModelSpec, settings: Settings) -> tuple[bool, int]:
    """(kv_unified, sequences) of a llama.cpp model: --sequences (GATEWAY_SEQUENCES) puts every
    model in the shared layout with that many sequences; else models.yaml's layout."""
    if settings.sequences is not None:
        return True, settings.sequences
    return spec.kv_unified, spec.sequences or 0


def engine_config(spec: ModelSpec, cand: Candidate, path: str, settings: Settings, mmproj: str = "") -> EngineConfig:
    """How `spec` is instantiated on `cand`: with its runtime's own options (validated by the
    runtime's options model) where the runtime is described."""
    rt = runtime(cand.runtime)
    return EngineConfig(
        model_path=path,
        context_length=spec.context_length,
        parallel=configured_parallel(spec, settings),
        n_threads=settings.threads,
        max_queue=settings.max_queue,
        backend=cand.backend,
        device=cand.device,
        device_key=cand.device_key,
        chat_template=spec.chat_template,
        pooling=spec.embedding.pooling,
        normalize_embeddings=spec.embedding.normalize,
        options=rt.load_options(runtime_option_values(spec, settings, mmproj).get(rt.name, {})) if rt is not None else None,
    )


def runtime_option_values(spec: ModelSpec, settings: Settings, mmproj: str = "") -> dict[str, dict[str, Any]]:
    """The runtimes' own options as models.yaml (its keys spread flat in a model's entry) and the
    settings give them, by runtime: the command line over models.yaml over the default."""
    kv_unified, sequences = kv_sharing(spec, settings)
    return {
        "llamacpp": {
            "device_sampling": settings.device_sampling or spec.device_sampling,
            "draft_ngram": spec.speculative.ngram if spec.speculative else 0,
            "draft_max": spec.speculative.max_draft if spec.speculative else 0,
            "draft_streams": spec.speculative.max_streams if spec.speculative else 0,
            "prefix_cache_mib": _first(settings.prefix_cache, spec.prefix_cache, -1),
            "pinned_host_cache": settings.pinned_host_cache,
            "prefill_budget": _first(settings.prefill_budget, spec.prefill_budget, 0),
            "cpu_variant": settings.cpu_variant or "",
            "swa_full": spec.swa_full,
            "kv_unified": kv_unified,
            "sequences": sequences,
            "mmproj": mmproj,
        },
        "coreml": {"compute_units": spec.compute_units},
    }


def _first(*values: int | None) -> int:
    """The first value that is set (the command line over models.yaml over the default)."""
    return next(v for v in values if v is not None)


def fingerprint_parts(host: HostCapabilities, cand: Candidate) -> tuple[str, str]:
    """(runtime build, driver) identities that a functional-check result depends on."""
    rt = runtime(cand.runtime)
    build = rt.fingerprint(host, cand.lib_path) if rt is not None and rt.fingerprint is not None else cand.runtime
    driver = ""
    if cand.backend == "vulkan":
        dev = next((d for d in host.vulkan.devices if d.index == cand.device_index), None)
        driver = f"{dev.driver_name} {dev.driver_info} {dev.driver_version}" if dev else ""
    elif cand.backend == "cuda":
        driver = f"{host.cuda.driver_version} cuda {host.cuda.cuda_version}"
    return build, driver


def _idle(engine: Engine) -> bool:
    h = engine.health()
    return h.running == 0 and h.waiting == 0
