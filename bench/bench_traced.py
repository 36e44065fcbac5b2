"""Traced mode speed on a Llama-2-70B-shaped model (80 layers, hidden 8192, 64 heads, 8 KV
heads, ffn 28672, vocab 32000), bf16 (pure bf16 weights by default; --dtype bf16-autocast
for fp32 master weights), micro-batch 1, seq 4096, AdamW, cuda kernel policy: replicated
trace (4 layers + exact replication), full 80-layer trace, tracer RSS, and torch's
MemTracker on the same step (on fewer layers, as it is slow), as a ratio. One warm-up trace
(imports, first-call caches) is not timed.

    python bench/bench_traced.py [--runs 3] [--memtracker-layers 8] [--skip-full] [--dtype bf16-pure]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

LLAMA2_70B = dict(
    model_type="llama",
    hidden_size=8192,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    intermediate_size=28672,
    vocab_size=32000,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
BATCH, SEQ = 1, 4096
DTYPE = "bf16-pure"


def set_dtype(dtype: str) -> None:
    global DTYPE
    DTYPE = dtype


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


CPU_TIMES: dict = {}


def timed(fn, runs, label=""):
    """Median wall seconds (and, in CPU_TIMES[label], median CPU seconds of this process:
    the machine is shared, so wall time includes waiting for a core)."""
    times, cpu, out = [], [], None
    for _ in range(runs):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    CPU_TIMES[label] = statistics.median(cpu)
    return statistics.median(times), times, out


def memtracker_seconds(layers: int) -> float:
    """MemTracker (torch.distributed._tools.mem_tracker) on the same step with `layers` layers."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from pipemem.traced.hf import Precision, build_model, fake_tensor_quirks, make_config
    from pipemem.traced.step import meta_to_fake

    cfg = make_config(LLAMA2_70B, "sdpa", layers)
    prec = Precision.parse(DTYPE)
    model = build_model(cfg, prec.param_dtype)
    t0 = time.perf_counter()
    with FakeTensorMode(), fake_tensor_quirks():
        meta_to_fake(model)
        ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        mt = MemTracker()
        mt.track_external(model, opt, ids)
        with mt:
            with torch.autocast("cpu", dtype=prec.autocast_dtype):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--memtracker-layers", type=int, default=8)
    ap.add_argument("--skip-full", action="store_true")
    ap.add_argument("--dtype", default=DTYPE)
    args = ap.parse_args()
    set_dtype(args.dtype)
    from pipemem.traced.hf import trace_hf_step
    from pipemem.traced.replicate import trace_hf_replicated
    from pipemem.units import fmt_bytes

    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"Llama-2-70B shape, {DTYPE}, b{BATCH} s{SEQ}, AdamW, kernel policy cuda; median of {args.runs}")
    trace_hf_step(LLAMA2_70B, BATCH, 128, dtype=DTYPE, layers=1)  # warm-up: imports, caches
    med, times, rep = timed(
        lambda: trace_hf_replicated(LLAMA2_70B, BATCH, SEQ, dtype=DTYPE), args.runs, "rep"
    )
    print(
        f"replicated trace (4 layers traced): {med:.2f} s (cpu {CPU_TIMES['rep']:.2f} s)  "
        f"runs={[round(t, 2) for t in times]}  "
        f"peak={fmt_bytes(rep.peak_bytes)} ({rep.peak_bytes} B) at {rep.peak_at}"
    )
    print(f"  tracer max RSS so far: {rss_gib():.2f} GiB")
    if not args.skip_full:
        medf, timesf, full = timed(
            lambda: trace_hf_step(LLAMA2_70B, BATCH, SEQ, dtype=DTYPE), max(1, args.runs - 1), "full"
        )
        print(
            f"full 80-layer trace: {medf:.2f} s (cpu {CPU_TIMES['full']:.2f} s)  "
            f"runs={[round(t, 2) for t in timesf]}  peak={fmt_bytes(full.peak_bytes)} ({full.peak_bytes} B); "
            f"replicated == full: {full.peak_bytes == rep.peak_bytes}"
        )
        print(f"  tracer max RSS: {rss_gib():.2f} GiB")
    k = args.memtracker_layers
    mt = memtracker_seconds(k)
    ours = timed(lambda: trace_hf_step(LLAMA2_70B, BATCH, SEQ, dtype=DTYPE, layers=k), 1)[0]
    print(
        f"MemTracker, {k} layers: {mt:.2f} s vs our full trace of {k} layers {ours:.2f} s "
        f"(ratio {mt / ours:.1f}x); per layer {mt / k:.2f} s -> ~{mt / k * 80:.0f} s for 80 layers "
        f"(linear extrapolation), {mt / k * 80 / med:.0f}x our replicated trace"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
