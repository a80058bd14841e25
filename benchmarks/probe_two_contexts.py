"""Can a long prompt's prefill run beside decoding streams without costing them?

The gateway feeds a long prompt in chunks inside the running streams' steps, one llama_context for
all. Where a step's costs add (llama.cpp's do: docs/benchmarks/history.md#why-no-prefill-budget-meets-both-interference-targets), the streams'
inter-token gap during the prefill and the prompt's time beside them trade against each other, and
"ITL p99 <= 3x the median" with "TTFT <= 1.3x alone" cannot both hold. This probe measures the one
way around it that the llama.cpp API offers: a second context on the same model (its own KV and,
on CUDA, its own streams) prefills the prompt on another thread while the first keeps decoding, so
a GPU can run the compute-bound prefill and the latency-bound decode at once; the prompt's KV then
moves into the serving context (llama_state_seq_get_data / set_data, timed here).

    python3 benchmarks/probe_two_contexts.py MODEL.gguf [--gpu] [--streams 32] [--prompt 11264]

Phases, in one process: the streams decode alone (their median step); the prompt alone in the
second context; both at once (the streams' steps while the prompt is fed; the prompt's time);
the same prompt fed as the gateway does, in chunks inside the streams' steps of one context
(for the baseline in the same run); the hand-over of the prompt's KV. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def load_model(path: str, gpu: bool) -> tuple[Any, Any]:
    """(llama_cpp, the model at `path`), every layer offloaded with `gpu` and none without."""
    import llama_cpp as lc

    from engines.llamacpp.ggml_backends import ensure_loaded

    ensure_loaded(None)  # a build with loadable backends (the CPU variants) needs them registered
    lc.llama_backend_init()
    mp = lc.llama_model_default_params()
    mp.n_gpu_layers = 999 if gpu else 0
    if not gpu:  # an empty device list: nothing offloaded, not even a large batch's matrices
        no_devices = (ctypes.c_void_p * 1)(None)
        mp.devices = ctypes.cast(no_devices, ctypes.c_void_p)
    model = lc.llama_model_load_from_file(path.encode(), mp)
    if not model:
        raise SystemExit(f"cannot load {path}")
    return lc, model


def new_context(lc: Any, model: Any, n_ctx: int, n_seq: int, n_batch: int, threads: int,
                unified: bool = False) -> Any:
    """A context of `n_ctx` tokens over `n_seq` sequences, passes of `n_batch` (= n_ubatch)."""
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_batch, n_seq
    cp.n_threads = cp.n_threads_batch = threads
    cp.kv_unified = unified
    cp.no_perf = True
    c = lc.llama_init_from_model(model, cp)
    if not c:
        raise SystemExit(f"cannot create a context of {n_ctx} tokens")
    return c


def fill_batch(b, rows: list[tuple[int, int, list[int], bool]]) -> None:
    """A llama_batch of `rows`: (sequence, first position, tokens, logits for the last)."""
    n = 0
    for seq, p0, toks, last in rows:
        for i, t in enumerate(toks):
            b.token[n], b.pos[n], b.n_seq_id[n] = t, p0 + i, 1
            b.seq_id[n][0] = seq
            b.logits[n] = last and i == len(toks) - 1
            n += 1
    b.n_tokens = n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--gpu", action="store_true", help="offload every layer (the CUDA/Vulkan build's first device)")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--stream-prompt", type=int, default=128, help="tokens each stream was prompted with")
    ap.add_argument("--prompt", type=int, default=11264, help="the long prompt's tokens")
    ap.add_argument("--chunk", type=int, default=512, help="the second context's batch (its prefill chunk)")
    ap.add_argument("--budgets", default="512", help="prompt tokens per mixed step for the one-context baseline")
    ap.add_argument("--threads", type=int, default=0, help="threads per context (0: all cores)")
    ap.add_argument("--decode-steps", type=int, default=60)
    ap.add_argument("--priority", action="store_true",
                    help="CUDA: the serving context's streams at the highest priority, the second context's at the "
                         "lowest (needs benchmarks/patches/ggml-cuda-green-contexts.patch in the build)")
    ap.add_argument("--green-sms", default="",
                    help="CUDA: comma-separated SM counts; for each, one more second context whose streams are in a "
                         "green context of that many SMs (the rest stay the decoding streams'), measured alone and "
                         "beside the streams (needs benchmarks/patches/ggml-cuda-green-contexts.patch in the build)")
    ap.add_argument("--json", default="")
    a = ap.parse_args()

    import os

    threads = a.threads or os.cpu_count() or 1
    lc, model = load_model(a.model, a.gpu)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    ctx_stream = a.stream_prompt + 1024

    def context(n_ctx: int, n_seq: int, n_batch: int) -> ctypes.c_void_p:
        return new_context(lc, model, n_ctx, n_seq, n_batch, threads)

    # The serving context: one KV stream per sequence (the gateway's default layout); one more
    # sequence than streams, for the baseline's prompt and the hand-over.
    n_seq = a.streams + 1
    serve = context(max(ctx_stream, a.prompt + 64) * n_seq, n_seq, 512)
    side = context(a.prompt + 64, 1, a.chunk)
    long_seq = a.streams
    tokens = [(7 * i + 13) % (n_vocab - 300) + 100 for i in range(a.prompt)]
    batch = lc.llama_batch_init(512, 0, 1)
    side_batch = lc.llama_batch_init(a.chunk, 0, 1)
    pos = [0] * n_seq

    def decode(c, b) -> None:
        rc = lc.llama_decode(c, b)
        if rc != 0:
            raise SystemExit(f"llama_decode failed: {rc}")
        lc.llama_synchronize(c)

    def step(extra: list[tuple[int, int, list[int], bool]] | None = None) -> float:
        rows = [(s, pos[s], [(pos[s] * 31 + s) % (n_vocab - 300) + 100], True) for s in range(a.streams)]
        fill_batch(batch, rows + (extra or []))
        t = time.perf_counter()
        decode(serve, batch)
        took = time.perf_counter() - t
        for s in range(a.streams):
            pos[s] += 1
        return took

    def reset_streams() -> None:
        mem = lc.llama_get_memory(serve)
        lc.llama_memory_clear(mem, True)
        for s in range(a.streams):
            pos[s] = 0
            fill_batch(batch, [(s, 0, tokens[s * 7: s * 7 + a.stream_prompt], True)])
            decode(serve, batch)
            pos[s] = a.stream_prompt

    def prefill(ctx, b, seq: int, chunk: int) -> float:
        """The prompt alone into sequence `seq` of `ctx`, in passes of `chunk`: its seconds."""
        t = time.perf_counter()
        for i in range(0, a.prompt, chunk):
            part = tokens[i:i + chunk]
            fill_batch(b, [(seq, i, part, i + len(part) == a.prompt)])
            decode(ctx, b)
        return time.perf_counter() - t

    def prefill_side(ctx=None) -> float:
        ctx = ctx or side
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        return prefill(ctx, side_batch, 0, a.chunk)

    def prefill_serving() -> float:
        """The prompt alone in the serving context, in passes of its batch (512), no streams."""
        took = prefill(serve, batch, long_seq, 512)
        lc.llama_memory_seq_rm(lc.llama_get_memory(serve), long_seq, -1, -1)
        return took

    def beside(ctx, t_ref: float) -> dict:
        """The streams' steps while ctx prefills the prompt on another thread."""
        reset_streams()
        done = threading.Event()
        took: list[float] = []

        def run_side() -> None:
            took.append(prefill_side(ctx))
            done.set()

        before = [step() for _ in range(10)]
        th = threading.Thread(target=run_side)
        th.start()
        during = []
        while not done.is_set():
            during.append(step())
        th.join()
        after = [step() for _ in range(10)]
        return {
            "prompt_ms": took[0] * 1e3, "prompt_ratio": took[0] / t_ref,
            "steps_during": len(during),
            "itl_before_p50_ms": statistics.median(before) * 1e3,
            "itl_during_p50_ms": statistics.median(during) * 1e3 if during else 0.0,
            "itl_during_p99_ms": pct(during, 99) * 1e3 if during else 0.0,
            "itl_during_max_ms": max(during) * 1e3 if during else 0.0,
            "itl_after_p50_ms": statistics.median(after) * 1e3,
        }

    res: dict = {"model": a.model, "gpu": a.gpu, "streams": a.streams, "prompt": a.prompt, "chunk": a.chunk,
                 "priority": a.priority}
    # Warm both contexts' shapes (the CUDA build's first pass of a shape is slow). A context makes
    # its CUDA streams on its first pass: with --priority the patched build reads
    # GGML_CUDA_STREAM_PRIORITY then (clamped to the device's range; lower runs first).
    if a.priority:
        os.environ["GGML_CUDA_STREAM_PRIORITY"] = "-100"
    reset_streams()
    for _ in range(5):
        step()
    if a.priority:
        os.environ["GGML_CUDA_STREAM_PRIORITY"] = "0"
    prefill_side()
    os.environ.pop("GGML_CUDA_STREAM_PRIORITY", None)
    # 1. The streams alone.
    reset_streams()
    alone_steps = [step() for _ in range(a.decode_steps)]
    d = statistics.median(alone_steps)
    res["decode_alone_ms"] = {"p50": d * 1e3, "p99": pct(alone_steps, 99) * 1e3}
    # 2. The prompt alone, in the second context.
    t_alone = min(prefill_side(), prefill_side())
    res["prompt_alone_ms"] = t_alone * 1e3
    # The prompt alone in the serving context (all of the GPU, passes of 512): "its time alone".
    reset_streams()
    prefill_serving()
    t_serving = min(prefill_serving(), prefill_serving())
    res["prompt_alone_serving_ms"] = t_serving * 1e3
    # 3. Both at once: the second context on its own thread.
    res["concurrent"] = beside(side, t_alone)
    # 3b. The same with the second context's kernels held to a green context of N SMs.
    res["green"] = []
    for n_sm in (int(x) for x in a.green_sms.split(",") if x.strip()):
        os.environ["GGML_CUDA_GREEN_SMS"] = str(n_sm)
        g = context(a.prompt + 64, 1, a.chunk)
        prefill_side(g)  # makes its streams (in the green context) and warms its shapes
        os.environ.pop("GGML_CUDA_GREEN_SMS", None)
        g_alone = min(prefill_side(g), prefill_side(g))
        row = beside(g, t_serving)
        row.update({"sms": n_sm, "prompt_alone_ms": g_alone * 1e3})
        res["green"].append(row)
        lc.llama_free(g)
    # 4. The hand-over: the prompt's KV from the side context into a sequence of the serving one.
    # A sequence's state names the context's KV streams (one per sequence in the default layout)
    # and holds cells for one: the side context's single stream becomes the serving context's
    # n_seq with the others empty (the format of llama_kv_cache::state_write in this build).
    size = lc.llama_state_seq_get_size(side, 0)
    buf = (ctypes.c_uint8 * size)()
    t = time.perf_counter()
    got = lc.llama_state_seq_get_data(side, buf, size, 0)
    t_get = time.perf_counter() - t
    raw = bytes(buf[:got])
    # [8-byte header][n_stream][each stream: cell count, then its cells unless 0]: the side
    # context's one stream, then empty ones (a restore puts the cells in the target's stream).
    streams_in = int.from_bytes(raw[8:12], "little")
    if streams_in == 1 and n_seq > 1:
        raw = raw[:8] + n_seq.to_bytes(4, "little") + raw[12:] + bytes(4 * (n_seq - 1))
    t = time.perf_counter()
    put = lc.llama_state_seq_set_data(serve, (ctypes.c_uint8 * len(raw)).from_buffer_copy(raw), len(raw), long_seq)
    lc.llama_synchronize(serve)
    t_set = time.perf_counter() - t
    # Check: the next token's logits in both contexts (same KV before it) agree.
    probe_token = tokens[0]
    fill_batch(batch, [(long_seq, a.prompt, [probe_token], True)])
    decode(serve, batch)
    mine = [lc.llama_get_logits_ith(serve, 0)[i] for i in range(n_vocab)]
    fill_batch(side_batch, [(0, a.prompt, [probe_token], True)])
    decode(side, side_batch)
    theirs = [lc.llama_get_logits_ith(side, 0)[i] for i in range(n_vocab)]
    diff = max(abs(x - y) for x, y in zip(mine, theirs, strict=True))
    same_top = mine.index(max(mine)) == theirs.index(max(theirs))
    res["handover"] = {"bytes": len(raw), "get_ms": t_get * 1e3, "set_ms": t_set * 1e3, "ok": bool(put),
                       "next_logits_max_abs_diff": diff, "same_argmax": same_top}
    lc.llama_memory_seq_rm(lc.llama_get_memory(serve), long_seq, -1, -1)
    # 5. The baseline: the prompt fed in chunks inside the streams' steps of one context.
    res["one_context"] = []
    for budget in (int(b) for b in a.budgets.split(",")):
        budget = min(budget, 512 - a.streams)  # as the gateway: a step is at most the batch (512)
        reset_streams()
        before = [step() for _ in range(10)]
        t0 = time.perf_counter()
        during = []
        for i in range(0, a.prompt, budget):
            part = tokens[i:i + budget]
            during.append(step([(long_seq, i, part, i + len(part) == a.prompt)]))
        t_one = time.perf_counter() - t0
        lc.llama_memory_seq_rm(lc.llama_get_memory(serve), long_seq, -1, -1)
        res["one_context"].append({
            "budget": budget, "prompt_ms": t_one * 1e3, "prompt_ratio": t_one / t_alone,
            "itl_before_p50_ms": statistics.median(before) * 1e3,
            "itl_during_p50_ms": statistics.median(during) * 1e3,
            "itl_during_p99_ms": pct(during, 99) * 1e3, "itl_during_max_ms": max(during) * 1e3,
        })

    c = res["concurrent"]
    print(f"decode alone: {a.streams} streams, step p50 {d * 1e3:.1f} ms; prompt of {a.prompt} alone: {t_alone * 1e3:.0f} ms "
          f"(second context, passes of {a.chunk}), {t_serving * 1e3:.0f} ms (serving context, passes of 512)")
    if a.priority:
        print("CUDA stream priorities: the decoding context's highest, the prefilling one's lowest")
    print("| how | prompt ms (x alone) | streams' step before p50 | during p50 / p99 / max ms | p99 / before p50 |")
    print("|---|---:|---:|---:|---:|")
    print(f"| two contexts, chunk {a.chunk} | {c['prompt_ms']:.0f} ({c['prompt_ratio']:.2f}) | {c['itl_before_p50_ms']:.1f} | "
          f"{c['itl_during_p50_ms']:.1f} / {c['itl_during_p99_ms']:.1f} / {c['itl_during_max_ms']:.1f} | "
          f"{c['itl_during_p99_ms'] / c['itl_before_p50_ms']:.2f} |")
    for r in res["one_context"]:
        print(f"| one context, budget {r['budget']} | {r['prompt_ms']:.0f} ({r['prompt_ratio']:.2f}) | {r['itl_before_p50_ms']:.1f} | "
              f"{r['itl_during_p50_ms']:.1f} / {r['itl_during_p99_ms']:.1f} / {r['itl_during_max_ms']:.1f} | "
              f"{r['itl_during_p99_ms'] / r['itl_before_p50_ms']:.2f} |")
    if res["green"]:
        print("| second context in a green context of N SMs, chunk | prompt alone ms | beside the streams ms "
              "(x serving alone) | before p50 | during p50 / p99 / max ms | p99 / before p50 |")
        print("|---|---:|---:|---:|---:|---:|")
    for r in res["green"]:
        print(f"| {r['sms']} SMs, chunk {a.chunk} | {r['prompt_alone_ms']:.0f} | {r['prompt_ms']:.0f} ({r['prompt_ratio']:.2f}) | "
              f"{r['itl_before_p50_ms']:.1f} | {r['itl_during_p50_ms']:.1f} / {r['itl_during_p99_ms']:.1f} / "
              f"{r['itl_during_max_ms']:.1f} | {r['itl_during_p99_ms'] / r['itl_before_p50_ms']:.2f} |")
    h = res["handover"]
    print(f"hand-over of the prompt's KV: {h['bytes'] / 2**20:.0f} MiB, get {h['get_ms']:.0f} ms + set {h['set_ms']:.0f} ms "
          f"(ok={h['ok']}; the next token's logits in both contexts: max |diff| {h['next_logits_max_abs_diff']:.4f}, "
          f"same argmax {h['same_argmax']})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    lc.llama_batch_free(batch)
    lc.llama_batch_free(side_batch)
    lc.llama_free(side)
    lc.llama_free(serve)
    lc.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
