"""`gateway parity`: compare an engine with a reference on one model; table, JSON, optional plot.

Exit status: 0 within tolerance, 1 outside, 2 when the comparison cannot run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

from gateway.models.registry import RegistryError, load_registry
from gateway.parity.compare import (
    DEFAULT_PROMPTS,
    DEFAULT_TOKENS,
    DEFAULT_TOP_K,
    ParityError,
    ParityReport,
    Scores,
    run_parity,
)
from gateway.settings import Settings, engine_choices

log = logging.getLogger(__name__)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("parity", help="compare an engine's logits with a reference engine's")
    p.add_argument("--model", default=None, help="model id (models.yaml's default otherwise)")
    p.add_argument("--engine", choices=engine_choices()[1:], default="cpu", help="candidate engine")
    p.add_argument("--reference", choices=engine_choices()[1:], default="cpu", help="reference engine")
    p.add_argument("--runtime", default=None, help="the candidate's runtime (default: the model's first)")
    p.add_argument("--reference-runtime", default=None,
                   help="the reference's runtime (default: --runtime), e.g. llamacpp vs ortgenai")
    p.add_argument("--candidate-file", default=None, metavar="PATH",
                   help="candidate model file instead of the model's own (e.g. another quantisation)")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="prompts: a JSON list of strings, or one per line (built-in set otherwise)")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="continuation tokens per prompt")
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K)
    p.add_argument("--config", default=None, help="models.yaml path")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per engine")
    p.add_argument("--json", default=None, metavar="OUT", help="write the full report here")
    p.add_argument("--plot", default=None, metavar="PNG", help="per-position KL chart (needs matplotlib)")
    p.set_defaults(func=main)


def read_prompts(path: str) -> list[str]:
    """A JSON list of strings, or one prompt per non-empty line."""
    text = Path(path).read_text(encoding="utf-8")
    if path.endswith(".json"):
        data = json.loads(text)
        if not isinstance(data, list) or not all(isinstance(x, str) for x in data):
            raise ValueError(f"{path}: expected a JSON list of strings")
        return data
    return [line for line in text.splitlines() if line.strip()]


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("error: --plot needs matplotlib: pip install 'llm-gateway[bench]'", file=sys.stderr)
            return 2
    try:
        settings = Settings.from_env(config=args.config, threads=args.threads, parallel=1)
        registry = load_registry(settings.config)
        model = args.model or registry.default
        spec = registry.get(model)
        if spec is None:
            raise ParityError(f"unknown model {model!r}; known: {', '.join(registry.models)}")
        prompts = read_prompts(args.prompts) if args.prompts else list(DEFAULT_PROMPTS)
        if not prompts:
            raise ParityError("no prompts")
        report = asyncio.run(
            run_parity(
                spec, registry, settings, engine=args.engine, reference=args.reference,
                runtime=args.runtime, reference_runtime=args.reference_runtime, prompts=prompts, tokens=args.tokens, top_k=args.top_k,
                candidate_path=args.candidate_file,
            )
        )
    except (ParityError, RegistryError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report, args.tokens))
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2))
    if args.plot:
        plot(report, args.plot)
    return 0 if report.passed else 1


def _row(name: str, s: Scores, diverge: str, verdict: str) -> list[str]:
    return [
        name, str(s.positions), f"{s.mean_kl:.3g}", f"{s.max_kl:.3g}", f"{s.top1:.3f}",
        f"{s.topk_overlap:.3f}", f"{s.max_abs_logit:.3g}", f"{s.ppl_ref:.4g}", f"{s.ppl_cand:.4g}",
        diverge, verdict,
    ]


def format_report(r: ParityReport, tokens: int) -> str:
    """The terminal table: one row per prompt, then the overall row, tolerance and verdict."""
    head = ["prompt", "pos", "mean KL", "max KL", "top-1", f"top-{r.top_k}", "max|dlogit|",
            "ppl ref", "ppl cand", "diverge", "verdict"]
    rows = [head]
    for i, p in enumerate(r.prompts):
        d = p.divergence
        div = "-" if d.position is None else f"@{d.position}{'' if d.within_top_k else ' (top-k!)'}"
        short = p.prompt.replace("\n", " ")
        short = short if len(short) <= 28 else short[:27] + "…"
        rows.append(_row(f"{i} {short}", p.scores, div, "pass" if p.passed else "FAIL"))
    rows.append(_row("all", r.overall, "", "pass" if r.passed else "FAIL"))
    widths = [max(len(row[c]) for row in rows) for c in range(len(head))]
    lines = [
        f"parity {r.model}: candidate {r.candidate} vs reference {r.reference}, weights {r.precision}, "
        f"{tokens} greedy tokens per prompt",
        "",
    ]
    for n, row in enumerate(rows):
        if n == len(rows) - 1:
            lines.append("-" * (sum(widths) + 2 * (len(widths) - 1)))
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    tol = ", ".join(f"{k}={v:g}" for k, v in r.tolerance.model_dump(exclude_none=True).items())
    lines += ["", f"tolerance: {tol}"]
    lines.append("PASS: within tolerance" if r.passed else "FAIL:\n  " + "\n  ".join(r.reasons))
    return "\n".join(lines)


def plot(r: ParityReport, path: str) -> None:
    """A PNG of KL(reference || candidate) at each continuation position, one line per prompt."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for i, p in enumerate(r.prompts):
        ax.plot(range(len(p.kl)), p.kl, marker=".", label=f"{i}: {p.prompt[:24]!r}")
    ax.set_xlabel("continuation position")
    ax.set_ylabel("KL(reference || candidate), nats")
    ax.set_title(f"{r.model}: {r.candidate} vs {r.reference}")
    if any(max(p.kl, default=0.0) > 0 for p in r.prompts):
        ax.set_yscale("symlog", linthresh=1e-6)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
