"""The speed comparison table in one command: the gateway vs llama-server on this host.

    .venv/bin/python benchmarks/bench_speed.py [--backend cpu|cuda|vulkan] [--rounds 4]
        [--concurrency 1,8,16] [--server-bin DIR] [--speculative 3:16] [--json out.json]
        [--gateway-variant 'no host cache:GATEWAY_PREFIX_CACHE=0' ...] [--baseline REV]

Same llama.cpp (llama-server is built from the sdist of the installed llama-cpp-python,
benchmarks/build-llama-server.sh, or taken from --server-bin), same model, same parallel sequences
and context, same closed-loop streaming client (`gateway bench`, 128 + 128 tokens, ignore_eos,
temperature 0), servers alternated within every round and the order reversed every other round.

Servers:
  gateway                 the defaults (engine in a worker; sampling on the device on a GPU)
  gateway, host sampling  GATEWAY_DEVICE_SAMPLING=off (on a GPU; on a CPU: "device sampling", =on):
                          lever 1 measured on its own
  llama-server            its defaults
  llama-server -bs        its backend sampling (experimental, off by default)

With --np streams every server is started anew for each concurrency with -np (the gateway's
--parallel) = that many streams, instead of once with the largest. With --llama-bench (and 1 in
--concurrency) one stream's decode speed is set beside llama-bench's tg128 on the same file, from an
empty KV and at the depth of the benchmark's prompts (the KV the stream decodes over).

With --baseline REV the gateway at git revision REV (a worktree made for the run, sharing this
virtualenv; or a directory holding that revision's files) serves next to the current tree in the
same rounds: a change's before and after on one machine in one run.

With --speculative N:M a second table compares prompt-lookup speculative decoding on prompts whose
answers copy from them (the repository's own source files, "reformat this code"): the gateway
with models.yaml `speculative: {ngram: N, max_draft: M}` and llama-server with
`--spec-type ngram-simple --spec-ngram-simple-size-n N --spec-ngram-simple-size-m M`, each next
to itself without.  Prints medians [min-max] of every round, TTFT p50 / p95, machine, commit and
the llama.cpp build.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.bench_vs_llama_server import MODEL, _wait  # noqa: E402
from benchmarks.bench_workers import _build_id  # noqa: E402
from gateway.host.ports import free_port  # noqa: E402


def _copy_prompts(n: int, lines: int = 40) -> list[str]:
    """Prompts whose best answer copies from them: a piece of this repository's code and the start of
    its copy.  About 500 prompt tokens each."""
    out: list[str] = []
    for path in sorted((ROOT / "engines").glob("*.py")) + sorted((ROOT / "gateway").rglob("*.py")):
        text = path.read_text().splitlines()
        for start in range(0, len(text) - lines, lines):
            chunk = "\n".join(text[start : start + lines])
            if len(chunk) < 1200:
                continue
            first = chunk.splitlines()[0]
            out.append(f"# {path.name}, lines {start + 1}-{start + lines}\n{chunk}\n\n"
                       f"# The same lines again, unchanged:\n{first}\n")
            if len(out) == n:
                return out
    return out


def _bench(url: str, load: float, n: int, args: argparse.Namespace, out: Path, seed: int, prompts: Path | None = None,
           open_loop: bool = False) -> dict[str, Any]:
    """`gateway bench` against one server: `load` streams in a closed loop, or (open_loop) Poisson
    arrivals at `load` requests a second."""
    mode = ["--rate", str(load)] if open_loop else ["--concurrency", str(int(load))]
    cmd = [sys.executable, "-m", "gateway.cli", "bench", "--url", url, "--model", MODEL, *mode,
           "--num-prompts", str(n), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--seed", str(seed), "--quiet", "--json", str(out)]
    if prompts is not None:
        cmd += ["--prompts-file", str(prompts)]
    out.unlink(missing_ok=True)
    subprocess.run(cmd, check=False, cwd=ROOT, stdout=subprocess.DEVNULL)
    result: dict[str, Any] = json.loads(out.read_text())
    if result["failed"]:
        print(f"{url}: {result['failed']} requests failed: {result['errors']}", file=sys.stderr)
    return result


class Servers:
    def __init__(self, args: argparse.Namespace, model: str, ctx: int, config: Path | None = None) -> None:
        self.args, self.model, self.ctx = args, model, ctx
        self.config = config  # the gateways' models.yaml (--gguf), unless one is given
        self.procs: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
        self.threads = str(os.cpu_count() or 1)

    def gateway(self, name: str, env: dict[str, str], config: Path | None = None, tree: Path = ROOT) -> None:
        port = free_port()
        full = {**os.environ, "GATEWAY_LOG_LEVEL": "warning", "GATEWAY_CHECK_MODELS": "0", **env}
        config = config or self.config
        if config is not None:
            full["GATEWAY_CONFIG"] = str(config)
        if tree != ROOT:  # its own code, in the gateway and in the engines' workers
            full["PYTHONPATH"] = str(tree)
        self.procs[name] = (subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--parallel", str(self.args.np),
             "--engine", self.args.backend], cwd=tree, env=full), port)

    def llama_server(self, name: str, bin_dir: str, extra: list[str]) -> None:
        port = free_port()
        gpu = ["-ngl", "99"] if self.args.backend != "cpu" else ["-ngl", "0", "--device", "none"]
        self.procs[name] = (subprocess.Popen(
            [f"{bin_dir}/llama-server", "-m", self.model, "--port", str(port), "-np", str(self.args.np),
             "-c", str(self.ctx * self.args.np), "-t", self.threads, "-tb", self.threads, "--log-disable", *gpu, *extra],
            env={**os.environ, "LD_LIBRARY_PATH": ":".join(filter(None, (bin_dir, os.environ.get("LD_LIBRARY_PATH"))))},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port)

    def wait(self) -> None:
        for proc, port in self.procs.values():
            _wait(f"http://127.0.0.1:{port}", proc)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.procs[name][1]}"

    def stop(self) -> None:
        for proc, _ in self.procs.values():
            proc.terminate()
        for proc, _ in self.procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _worktree(rev: str, work: Path) -> Path:
    """A checkout of `rev` for a baseline gateway (removed from git's list at exit; files stay in
    `work`); a directory holding a checkout (e.g. `git archive REV | tar x -C DIR`, for a host
    without the repository's history) is used as it is."""
    if Path(rev).is_dir():
        return Path(rev).resolve()
    tree = work / "baseline"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=ROOT, check=True,
                   capture_output=True)
    atexit.register(subprocess.run, ["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                    capture_output=True)
    return tree


def _rounds(servers: Servers, names: list[str], conc: list[Any], args: argparse.Namespace, tag: str,
            prompts: Path | None = None, open_loop: bool = False) -> dict[str, dict[Any, list[dict[str, Any]]]]:
    """Every server at every load (streams, or with open_loop requests a second), alternated."""
    results: dict[str, dict[Any, list[dict[str, Any]]]] = {n: {c: [] for c in conc} for n in names}
    tmp = Path(tempfile.gettempdir())
    for r in range(args.rounds):
        for c in conc:
            order = names if r % 2 == 0 else list(reversed(names))
            n = max(args.min_prompts, round(c * args.open_seconds) if open_loop else c * args.per_stream)
            for name in order:
                res = _bench(servers.url(name), c, n, args, tmp / f"bench-speed-{tag}.json",
                             args.seed + 1000 * r + round(c), prompts, open_loop)
                results[name][c].append(res)
                print(f"{tag} round {r} {name:<24} {'rate' if open_loop else 'c'}={c:<3} "
                      f"{res['output_token_throughput']:8.1f} tok/s "
                      f"ttft p50 {res['ttft']['p50'] * 1e3:6.1f} ms itl p50 {res['itl']['p50'] * 1e3:5.1f} "
                      f"p99 {res['itl']['p99'] * 1e3:6.1f} ms", file=sys.stderr)
    return results


def _table(results: dict[str, dict[Any, list[dict[str, Any]]]], conc: list[Any], ratios: list[tuple[str, str]],
           decode: bool = False, load: str = "streams") -> list[str]:
    """Aggregate output tok/s (with --decode: per-stream decode speed, 1 / TPOT p50, instead); the
    gaps between a stream's tokens at p50, p99 and their longest (max: one stall a reader sees)."""
    names = list(results)
    unit = "decode tok/s per stream" if decode else "tok/s"
    lines = [f"| {load} | " + " | ".join(f"{n} {unit}" for n in names) + " | "
             + "".join(f"{a} / {b} | " for a, b in ratios)
             + " | ".join(f"TTFT p50 / p95 ms {n}" for n in names) + " | "
             + " | ".join(f"ITL p50 / p99 / max ms {n}" for n in names) + " |",
             "|---" * (1 + 3 * len(names) + len(ratios)) + "|"]
    for c in conc:
        med: dict[str, float] = {}
        cells, ttft, itl = [], [], []
        for n in names:
            runs = results[n][c]
            tps = [1 / x["tpot"]["p50"] if decode else x["output_token_throughput"] for x in runs]
            med[n] = statistics.median(tps)
            cells.append(f"{med[n]:.1f} [{min(tps):.0f}-{max(tps):.0f}]")
            ttft.append(f"{statistics.median(x['ttft']['p50'] for x in runs) * 1e3:.0f} / "
                        f"{statistics.median(x['ttft']['p95'] for x in runs) * 1e3:.0f}")
            itl.append(f"{statistics.median(x['itl']['p50'] for x in runs) * 1e3:.1f} / "
                       f"{statistics.median(x['itl']['p99'] for x in runs) * 1e3:.1f} / "
                       f"{statistics.median(x['itl'].get('max', float('nan')) for x in runs) * 1e3:.0f}")
        rs = [f"**{med[a] / med[b]:.2f}**" if med.get(b) else "-" for a, b in ratios]
        lines.append(f"| {c} | " + " | ".join(cells) + " | " + "".join(f"{r} | " for r in rs) + " | ".join(ttft) + " | "
                     + " | ".join(itl) + " |")
    return lines


def _other_sampling(backend: str) -> str:
    """The sampling path that is not the default one: host sampling on a GPU, device on a CPU."""
    return "gateway, device sampling" if backend == "cpu" else "gateway, host sampling"


def _throughput(args: argparse.Namespace, model: str, ctx: int, gguf_config: Path | None, work: Path,
                conc: list[Any], bin_dir: str, open_loop: bool = False) -> tuple[list[str], dict[str, dict[Any, list[dict[str, Any]]]]]:
    """Every server of the throughput table started with -np `args.np`, then the rounds at `conc`
    (streams, or with open_loop requests a second)."""
    servers = Servers(args, model, ctx, gguf_config)
    servers.gateway("gateway", {})
    names = ["gateway"]
    # The other sampling path next to the default one.
    other = _other_sampling(args.backend)
    if not args.no_other_sampling:
        servers.gateway(other, {"GATEWAY_DEVICE_SAMPLING": "on" if args.backend == "cpu" else "off"})
        names.append(other)
    if args.baseline:
        base = f"gateway @{args.baseline}"
        servers.gateway(base, {}, config=gguf_config or ROOT / "models.yaml", tree=_worktree(args.baseline, work))
        names.append(base)
    for variant in args.gateway_variant:
        label, _, settings = variant.partition(":")
        name = f"gateway, {label}"
        servers.gateway(name, dict(kv.split("=", 1) for kv in settings.split(",") if kv))
        names.append(name)
    if not args.no_llama_server:
        servers.llama_server("llama-server", bin_dir, [])
        names.append("llama-server")
    if not args.no_backend_sampling and not args.no_llama_server:
        servers.llama_server("llama-server -bs", bin_dir, ["--backend-sampling"])
        names.append("llama-server -bs")
    try:
        servers.wait()
        return names, _rounds(servers, names, conc, args, "open loop" if open_loop else "throughput", open_loop=open_loop)
    finally:
        servers.stop()


def _single_stream(results: dict[str, dict[int, list[dict[str, Any]]]], bin_dir: str, model: str,
                   args: argparse.Namespace) -> list[str]:
    """One stream's decode speed (1 / TPOT p50, median of the rounds) beside llama-bench's tg128 on
    the same file and build: from an empty KV (llama-bench's default) and after as many tokens as
    the benchmark's prompts (`-d`, the KV the stream decodes over)."""
    gpu = ["-ngl", "99"] if args.backend != "cpu" else ["-ngl", "0"]
    out = subprocess.run([f"{bin_dir}/llama-bench", "-m", model, "-p", "0", "-n", "128", "-d", f"0,{args.input_len}",
                          "-r", "5", "-o", "json", "-t", str(os.cpu_count() or 1), *gpu],
                         capture_output=True, text=True, check=False, env={**os.environ, "LD_LIBRARY_PATH": bin_dir})
    if out.returncode != 0:  # the rest of the report stands (e.g. the AMX crash of a CPU build: docs/benchmarks.md)
        tail = (out.stderr.strip().splitlines() or [""])[-1]
        return [f"llama-bench failed (exit {out.returncode}): {tail}", ""]
    runs = json.loads(out.stdout)
    tg = {int(r.get("n_depth", 0)): float(r["avg_ts"]) for r in runs}
    at = tg.get(args.input_len, tg[0])
    fa = {-1: "auto", 0: "off", 1: "on"}.get(runs[0].get("flash_attn"), "?")
    lines = [f"One stream's decode speed (1 / TPOT p50) against llama-bench tg128 (5 repetitions, flash attention "
             f"{fa}) on the same file, from an empty KV and after {args.input_len} tokens (the stream's own prompt):", "",
             f"| server | decode tok/s | / tg128 | / tg128 at depth {args.input_len} |", "|---|---|---|---|"]
    for name, by_conc in results.items():
        speed = statistics.median(1 / x["tpot"]["p50"] for x in by_conc[1])
        lines.append(f"| {name} | {speed:.1f} | **{speed / tg[0]:.3f}** | **{speed / at:.3f}** |")
    return [*lines, f"| llama-bench tg128 | {tg[0]:.1f} / {at:.1f} at depth {args.input_len} | 1 | 1 |", ""]


def _ratios(names: list[str], args: argparse.Namespace) -> list[tuple[str, str]]:
    """The table's throughput ratios: the gateway against llama-server and against each variant."""
    other = _other_sampling(args.backend)
    ratios = [("gateway", "llama-server")] * (not args.no_llama_server) + \
        [("gateway", n) for n in names if n.startswith(("gateway, ", "gateway @")) and n != other]
    if other in names:
        ratios.append(("gateway", other))
    if "llama-server -bs" in names:
        ratios.append(("gateway", "llama-server -bs"))
    return ratios


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cpu", help="cpu, vulkan or cuda: the gateway's --engine and llama-server's build")
    ap.add_argument("--concurrency", default="1,8,16")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--per-stream", type=int, default=3, help="requests per concurrent stream")
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--server-bin", default=None, help="an existing llama-server build's bin dir")
    ap.add_argument("--no-other-sampling", action="store_true",
                    help="leave out the gateway with the other GATEWAY_DEVICE_SAMPLING (on for cpu, off for a GPU)")
    ap.add_argument("--no-llama-server", action="store_true",
                    help="gateways only (with --baseline: a change's before and after)")
    ap.add_argument("--no-backend-sampling", action="store_true", help="leave out llama-server --backend-sampling")
    ap.add_argument("--speculative", default=None, metavar="N:M",
                    help="also compare n-gram speculative decoding (lookup n-gram N, draft up to M) on copying prompts")
    ap.add_argument("--spec-concurrency", default="1,4")
    ap.add_argument("--gateway-variant", action="append", default=[], metavar="NAME:VAR=VALUE[,VAR=VALUE]",
                    help="also a gateway with these environment settings, e.g. 'no host cache:GATEWAY_PREFIX_CACHE=0'")
    ap.add_argument("--baseline", default=None, metavar="REV",
                    help="also serve the gateway at this git revision, or from this directory holding one "
                         "(before/after a change, one run)")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--rates", default="", metavar="R1,R2",
                    help="also an open loop: Poisson arrivals at these requests a second, every server with -np = "
                         "the largest --concurrency (no lockstep of a closed loop's equal requests)")
    ap.add_argument("--open-seconds", type=float, default=60, help="the open loop's requests: rate x this many")
    ap.add_argument("--gguf", default=None, metavar="PATH",
                    help="serve this GGUF as the model on every server (e.g. benchmarks/make_random_llama.py's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the table, the machine and every round's numbers here")
    ap.add_argument("--np", dest="np_mode", choices=("max", "streams"), default="max",
                    help="every server's parallel sequences: the largest --concurrency (max), or servers started "
                         "anew for each concurrency with that many (streams)")
    ap.add_argument("--llama-bench", action="store_true",
                    help="also one stream's decode speed against llama-bench tg128 (needs 1 in --concurrency and a "
                         "llama-bench beside llama-server: LLAMA_TARGETS=llama-bench)")
    args = ap.parse_args()
    conc = [int(c) for c in args.concurrency.split(",")]
    spec_conc = [int(c) for c in args.spec_concurrency.split(",")]
    args.np = max(conc + (spec_conc if args.speculative else []))
    if args.llama_bench and (1 not in conc or args.no_llama_server or args.skip_throughput):
        ap.error("--llama-bench needs 1 in --concurrency, the throughput table and a llama-server build")
    from gateway.models.registry import load_registry

    reg = load_registry(ROOT / "models.yaml")
    spec = reg.models[MODEL]
    model = str(Path(args.gguf).resolve()) if args.gguf else str(reg.resolve(spec, "gguf"))
    bin_dir, version = "", ["version: (not run)"]
    if not args.no_llama_server:
        bin_dir = args.server_bin or subprocess.run(
            ["bash", str(ROOT / "benchmarks/build-llama-server.sh"), args.backend], check=True, capture_output=True,
            text=True).stdout.strip().splitlines()[-1]
        version = subprocess.run([f"{bin_dir}/llama-server", "--version"], capture_output=True, text=True,
                                 env={**os.environ, "LD_LIBRARY_PATH": bin_dir}).stderr.strip().splitlines()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    if not commit and (env := ROOT / "offline-bundle" / "bundle.env").exists():  # installed from an offline bundle
        commit = next((v for k, _, v in (x.partition("=") for x in env.read_text().splitlines()) if k == "BUNDLE_COMMIT"), "")
    report = [f"machine: {platform.machine()} {os.cpu_count()} cores, {platform.platform()}; commit {commit}",
              f"gateway: {_build_id()}, --engine {args.backend}, workers on; model {Path(model).name}",
              f"llama-server: {bin_dir} ({'; '.join(v for v in version if 'version' in v or 'built' in v)})",
              f"-np {args.np if args.np_mode == 'max' else '= streams'} and {spec.context_length} tokens per sequence on every server; {args.rounds} rounds "
              "alternated; medians [min-max] of the rounds", ""]
    everything: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="bench-speed-"))
    gguf_config = None
    if args.gguf:
        data = yaml.safe_load((ROOT / "models.yaml").read_text())
        next(x for x in data["models"] if x["id"] == MODEL)["formats"] = {"gguf": {"path": str(Path(args.gguf).resolve())}}
        gguf_config = work / "gguf.yaml"
        gguf_config.write_text(yaml.safe_dump(data))
    if not args.skip_throughput:
        # -np = the largest concurrency on every server, or (--np streams) servers started anew for
        # each concurrency with -np = that many streams.
        levels = [conc] if args.np_mode == "max" else [[c] for c in conc]
        results: dict[str, dict[int, list[dict[str, Any]]]] = {}
        for level in levels:
            at = argparse.Namespace(**{**vars(args), "np": max(level) if args.np_mode == "streams" else args.np})
            names, part = _throughput(at, model, spec.context_length, gguf_config, work, level, bin_dir)
            for name in names:
                results.setdefault(name, {}).update(part[name])
        everything["throughput"] = results
        report += [f"Synthetic prompts, {args.input_len} + {args.output_len} tokens, ignore_eos, temperature 0:", "",
                   *_table(results, conc, _ratios(names, args)), ""]
        if args.llama_bench:
            report += _single_stream(results, bin_dir, model, args)
    if args.rates:
        rates = [float(r) for r in args.rates.split(",")]
        at = argparse.Namespace(**{**vars(args), "np": max(conc)})
        names, opened = _throughput(at, model, spec.context_length, gguf_config, work, rates, bin_dir, open_loop=True)
        everything["open_loop"] = opened
        report += [f"Open loop: Poisson arrivals, {args.open_seconds:.0f} s of requests at each rate, -np {max(conc)}, "
                   f"{args.input_len} + {args.output_len} tokens, ignore_eos, temperature 0:", "",
                   *_table(opened, rates, _ratios(names, args), load="req/s"), ""]
    if args.speculative:
        n, m = (int(x) for x in args.speculative.split(":"))
        prompts = work / "copy.jsonl"
        prompts.write_text("\n".join(json.dumps(p) for p in _copy_prompts(max(args.min_prompts, max(spec_conc) * args.per_stream))))
        data = yaml.safe_load((ROOT / "models.yaml").read_text())
        next(x for x in data["models"] if x["id"] == MODEL)["speculative"] = {"ngram": n, "max_draft": m}
        cfg = work / "models.yaml"
        cfg.write_text(yaml.safe_dump(data))
        servers = Servers(args, model, spec.context_length)
        servers.gateway("gateway", {})
        servers.gateway("gateway, ngram", {}, config=cfg)
        servers.llama_server("llama-server", bin_dir, [])
        servers.llama_server("llama-server, ngram", bin_dir, [
            "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(n), "--spec-ngram-simple-size-m", str(m)])
        names = ["gateway", "gateway, ngram", "llama-server", "llama-server, ngram"]
        try:
            servers.wait()
            results = _rounds(servers, names, spec_conc, args, "speculative", prompts)
        finally:
            servers.stop()
        everything["speculative"] = results
        report += [f"Speculative decoding, prompt lookup (n-gram {n}, drafts up to {m}) on prompts that are copied "
                   f"({args.output_len} output tokens, ignore_eos, temperature 0):", "",
                   *_table(results, spec_conc, [("gateway, ngram", "gateway"), ("llama-server, ngram", "llama-server"),
                                                ("gateway, ngram", "llama-server, ngram")], decode=True), "",
                   "Aggregate tok/s of the same runs (prefill of the ~500-token prompts included):", "",
                   *_table(results, spec_conc, [("gateway, ngram", "gateway"), ("llama-server, ngram", "llama-server"),
                                                ("gateway, ngram", "llama-server, ngram")]), ""]
    print("\n".join(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"report": report, **everything}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
