#!/usr/bin/env python3
"""The torch peer of bench/bench_cuda_moe.cpp, run in the same GPU call.

Times torch._grouped_mm at the grouped expert GEMM shapes of bench_cuda_moe (36 groups of ~910 and
~3641 rows; gate_up N 4096 K 4096, down N 4096 K 2048; forward, dX and dW), a dense 8192^3 bf16
torch.mm as the ceiling, and torch SDPA (causal, dense) at the sparse-attention bench's shape for
the dense-attention comparison. Random bf16 inputs, CUDA-event medians after warm-up runs.

Usage: python3 bench/grouped_mm_vs_torch.py [--out results.json]
"""

import argparse
import json
import statistics

import torch

EXPERTS = 36
HIDDEN = 4096
MOE_WIDTH = 2048


def median_ms(fn, warmup=3, iters=20):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def row(rows, op, shape, ms, flop):
    tflops = flop / (ms * 1e-3) / 1e12 if flop else 0.0
    rows.append({"op": op, "shape": shape, "ms": ms, "tflops": tflops})


def grouped(rows, name, per_group, n, k):
    total = per_group * EXPERTS
    dev = "cuda"
    x = torch.randn(total, k, device=dev, dtype=torch.bfloat16)
    # Weights stored [E, N, K] as in glmtune; _grouped_mm takes [E, K, N] (a transposed view).
    w = torch.randn(EXPERTS, n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    dy = torch.randn(total, n, device=dev, dtype=torch.bfloat16)
    offs = torch.arange(1, EXPERTS + 1, device=dev, dtype=torch.int32) * per_group
    flop = 2.0 * total * n * k
    shape = f"36x{per_group} N{n} K{k}"
    w_kn = w.transpose(-2, -1)
    row(rows, f"{name} fwd torch._grouped_mm", shape,
        median_ms(lambda: torch._grouped_mm(x, w_kn, offs=offs)), flop)
    # dX = dY · W[g]: W[g] as [N, K] is mat_b's row-major form; use a column-major copy if the
    # kernel insists (prepared outside the timing).
    try:
        torch._grouped_mm(dy, w, offs=offs)
        w_nk = w
    except RuntimeError:
        w_nk = w.transpose(-2, -1).contiguous().transpose(-2, -1)
    row(rows, f"{name} dX torch._grouped_mm", shape,
        median_ms(lambda: torch._grouped_mm(dy, w_nk, offs=offs)), flop)
    # dW[g] = dY_g^T · X_g: the 2-D x 2-D form, groups along the summed dimension.
    dy_t = dy.t()
    try:
        torch._grouped_mm(dy_t, x, offs=offs)
    except RuntimeError:
        dy_t = dy.t().contiguous()
    row(rows, f"{name} dW torch._grouped_mm", shape,
        median_ms(lambda: torch._grouped_mm(dy_t, x, offs=offs)), flop)


def sdpa(rows, tokens, heads, dim):
    q, k, v = (torch.randn(1, heads, tokens, dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    do = torch.randn(1, heads, tokens, dim, device="cuda", dtype=torch.bfloat16)
    fwd_flop = 4.0 * tokens * tokens / 2 * heads * dim  # causal half
    shape = f"T{tokens} H{heads} D{dim} causal"

    def fwd():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd_bwd():
        out = fwd()
        out.backward(do)

    row(rows, "SDPA dense fwd", shape, median_ms(fwd, 3, 10), fwd_flop)
    row(rows, "SDPA dense fwd+bwd", shape, median_ms(fwd_bwd, 3, 10), 3.5 * fwd_flop)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(20261129)
    rows = []
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    row(rows, "torch.mm 8192^3 (ceiling)", "8192x8192x8192", median_ms(lambda: a @ b.t()),
        2.0 * 8192**3)
    dense = rows[-1]["tflops"]
    del a, b
    for per_group in (910, 3641):
        grouped(rows, "gate_up", per_group, 2 * MOE_WIDTH, HIDDEN)
        grouped(rows, "down", per_group, HIDDEN, MOE_WIDTH)
    torch.cuda.empty_cache()
    try:
        sdpa(rows, 4096, 64, 256)
    except RuntimeError as err:  # a backend without head dim 256 support
        print(f"SDPA skipped: {err}")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"{'op':<40} {'shape':<24} {'median ms':>10} {'TFLOP/s':>9} {'of dense':>9}")
    for r in rows:
        frac = f"{100 * r['tflops'] / dense:.0f}%" if r["tflops"] else "-"
        print(f"{r['op']:<40} {r['shape']:<24} {r['ms']:>10.3f} {r['tflops']:>9.1f} {frac:>9}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
