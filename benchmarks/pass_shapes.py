"""What one model pass costs by its shape: prompt tokens of one sequence or of several, beside
decoding streams or alone, in one KV stream per sequence (the gateway's layout) or one shared
(kv_unified, llama-server's), against llama-bench's pp on the same file.

A burst of prompts is fed in passes of the prefill budget; how fast those passes run bounds how
soon the burst's last first token comes. llama.cpp splits a pass over one KV stream per sequence
into micro-batches of equal tokens per sequence, so prompts of unequal lengths in one pass, or a
prompt beside single-token streams, may cost more than the same tokens of one sequence.

    python3 benchmarks/pass_shapes.py MODEL.gguf --gpu [--streams 32] [--lens 135,135,135,107] \
        [--llama-bench DIR]

Prints one table (median of --reps timed passes each, every one from the same KV state);
--json writes it too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.probe_two_contexts import fill_batch, load_model, new_context  # noqa: E402

Rows = list[tuple[int, int, list[int], bool]]  # (sequence, first position, tokens, logits for the last)


def pp_llama_bench(bin_dir: str, model: str, budget: int, gpu: bool) -> float:
    """llama-bench's prompt processing of `budget` tokens in one micro-batch (tok/s), or 0."""
    cmd = [f"{bin_dir}/llama-bench", "-m", model, "-p", str(budget), "-n", "0", "-b", str(budget),
           "-ub", str(budget), "-r", "5", "-o", "json", "-t", str(os.cpu_count() or 1), "-ngl", "99" if gpu else "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600,
                         env={**os.environ, "LD_LIBRARY_PATH": bin_dir})
    try:
        return float(json.loads(out.stdout)[0]["avg_ts"])
    except (ValueError, KeyError, IndexError):
        print(f"llama-bench failed (exit {out.returncode}): {out.stderr[-500:]}", file=sys.stderr)
        return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--gpu", action="store_true", help="offload every layer (the build's first device)")
    ap.add_argument("--streams", type=int, default=32, help="decoding streams beside the prompts")
    ap.add_argument("--depth", type=int, default=128, help="tokens each stream already holds")
    ap.add_argument("--budget", type=int, default=512, help="tokens a pass takes (n_batch = n_ubatch)")
    ap.add_argument("--lens", default="135,135,135,107",
                    help="the prompt pieces of one pass, as the scheduler cuts a burst of ~135-token prompts")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--llama-bench", default="", help="directory of llama-bench: its pp of --budget tokens beside")
    ap.add_argument("--json", default="")
    a = ap.parse_args()

    lc, model = load_model(a.model, a.gpu)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    lens = [int(x) for x in a.lens.split(",") if x]
    n_seq = a.streams + max(len(lens), a.budget // 128)
    n_ctx_seq = a.depth + a.budget + 64

    def tok(i: int, s: int) -> int:
        return (31 * i + 7 * s) % (n_vocab - 300) + 100

    def shapes() -> dict[str, tuple[bool, Rows]]:
        """name: (the streams hold their depth first, the pass's rows)."""
        p0 = a.streams  # the prompts' sequences come after the streams'
        decode = [(s, a.depth, [tok(a.depth, s)], True) for s in range(a.streams)]
        one = [(p0, 0, [tok(i, p0) for i in range(a.budget)], True)]
        k = max(1, a.budget // 128)
        equal = [(p0 + j, 0, [tok(i, p0 + j) for i in range(a.budget // k)], True) for j in range(k)]
        cut = [(p0 + j, 0, [tok(i, p0 + j) for i in range(n)], True) for j, n in enumerate(lens)]
        room = a.budget - a.streams
        mixed, left = [], room
        for j, n in enumerate(lens):
            take = min(n, left)
            if take > 0:
                mixed.append((p0 + j, 0, [tok(i, p0 + j) for i in range(take)], True))
            left -= take
        out = {f"{a.streams} streams decoding": (True, decode), f"1 prompt x {a.budget}": (False, one)}
        if k > 1:  # (a budget under 256 holds one 128-token prompt: the shape above)
            out[f"{k} prompts x {a.budget // k}"] = (False, equal)
        out[f"prompts {a.lens}"] = (False, cut)
        out[f"{a.streams} streams + prompts to {a.budget}"] = (True, decode + mixed)
        return out

    batch = lc.llama_batch_init(max(a.budget, a.streams * 2 + sum(lens)), 0, 1)

    def run(ctx, rows: Rows) -> float:
        fill_batch(batch, rows)
        t0 = time.perf_counter()
        if lc.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        lc.llama_synchronize(ctx)
        return time.perf_counter() - t0

    def prime(ctx, streams: bool) -> None:
        """The KV as the pass finds it: empty, or the streams each holding their depth."""
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        if not streams:
            return
        per = max(1, a.budget // a.depth)  # streams whose whole depth fits one pass
        for s0 in range(0, a.streams, per):
            for p0 in range(0, a.depth, a.budget):
                end = min(a.depth, p0 + a.budget)
                run(ctx, [(s, p0, [tok(i, s) for i in range(p0, end)], False)
                          for s in range(s0, min(a.streams, s0 + per))])

    table = []
    pp = pp_llama_bench(a.llama_bench, a.model, a.budget, a.gpu) if a.llama_bench else 0.0
    for unified in (False, True):
        ctx = new_context(lc, model, n_ctx_seq * n_seq, n_seq, a.budget, os.cpu_count() or 1, unified)
        for name, (streams, rows) in shapes().items():
            times = []
            for r in range(a.reps + 2):
                prime(ctx, streams)
                took = run(ctx, rows)
                if r >= 2:  # the first passes of a shape load its kernels
                    times.append(took)
            prompt = sum(len(t) for s, _, t, _ in rows if s >= a.streams)
            ms = statistics.median(times) * 1e3
            table.append({"layout": "shared (kv_unified)" if unified else "a KV stream per sequence",
                          "pass": name, "tokens": sum(len(t) for *_, t, _ in rows), "prompt_tokens": prompt,
                          "ms": ms, "prompt_tok_s": prompt / ms * 1e3 if prompt else 0.0})
        lc.llama_free(ctx)

    print(f"# {a.model}, {'GPU' if a.gpu else 'CPU'}, passes of {a.budget} tokens, median of {a.reps}")
    if pp:
        print(f"llama-bench pp{a.budget} (-ub {a.budget}): {pp:.0f} tok/s")
    print("\n| layout | pass | tokens | ms | prompt tok/s |" + (" / llama-bench pp |" if pp else ""))
    print("|---|---|---|---|---|" + ("---|" if pp else ""))
    for row in table:
        ratio = f" {row['prompt_tok_s'] / pp:.2f} |" if pp and row["prompt_tokens"] else (" |" if pp else "")
        print(f"| {row['layout']} | {row['pass']} | {row['tokens']} | {row['ms']:.2f} | "
              f"{row['prompt_tok_s']:.0f} |{ratio}")
    if a.json:
        Path(a.json).write_text(json.dumps({"llama_bench_pp": pp, "rows": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
