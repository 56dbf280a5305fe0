"""FLA's chunk_kda on the shapes of bench/bench_cuda_kda.cpp, for a side-by-side table.

Times the forward and forward+backward of `fla.ops.kda.chunk_kda` (flash-linear-attention) with
the gate, the q/k L2 norm and the beta sigmoid inside its kernels (safe gate, lower bound -5), bf16
inputs, H = 64 heads of 128, at T = 16384 as 4 documents of 4096 (varlen) and at T = 8192 as one
document. Triton autotunes on the first call of every new shape (minutes): the warm-up covers it
and is not timed. Medians of CUDA-event timings.

A full autotune costs about 250 s per shape on an H200 (each of FLA's kernels compiles and times
every config). `--max-configs N` (default 0 = all) keeps N configs of every `triton.autotune`
list, evenly spread over the list (N = 1: its middle entry), by wrapping `triton.autotune` before
FLA is imported; the configs each kernel ran with are printed. With few configs FLA may run slower
than fully tuned, so a limited run is a bound on FLA's time from above.

Usage: python3 bench/kda_vs_fla.py [--out results.txt] [--shapes varlen,single] [--max-configs N]
"""

import argparse
import statistics
import sys
import time

import torch


def limit_autotune(max_configs):
    """Wraps triton.autotune so that every kernel decorated after this keeps `max_configs` of its
    configs, evenly spread; returns (kernel name, kept, total, autotuner) for each."""
    import triton
    import triton.runtime.autotuner as autotuner_mod

    original = autotuner_mod.autotune
    tuners = []

    def autotune(configs, key, *args, **kwargs):
        total = len(configs)
        if total > max_configs:
            picks = sorted({int((i + 0.5) * total / max_configs) for i in range(max_configs)})
            configs = [configs[i] for i in picks]
        decorate = original(configs, key, *args, **kwargs)

        def wrap(fn):
            tuner = decorate(fn)
            name = getattr(getattr(tuner, "base_fn", None), "__name__", None) or getattr(
                fn, "__name__", str(fn))
            tuners.append((name, len(configs), total, tuner))
            return tuner

        return wrap

    triton.autotune = autotune
    autotuner_mod.autotune = autotune
    return tuners


def median_ms(fn, warmup, iters):
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


def bench_shape(chunk_kda, lengths, heads=64, dim=128):
    total = sum(lengths)
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(20261129)

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, device=dev, generator=gen) * std).to(torch.bfloat16)

    q = rnd(1, total, heads, dim).requires_grad_()
    k = rnd(1, total, heads, dim).requires_grad_()
    v = rnd(1, total, heads, dim).requires_grad_()
    g = rnd(1, total, heads, dim).requires_grad_()
    beta = rnd(1, total, heads).requires_grad_()
    a_log = (torch.randn(heads, device=dev, generator=gen) * 0.5).float().requires_grad_()
    dt_bias = (torch.randn(heads * dim, device=dev, generator=gen) * 0.5).float().requires_grad_()
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.long)
    cu_dev = cu.to(dev)
    dout = rnd(1, total, heads, dim)

    def forward():
        return chunk_kda(q, k, v, g, beta, scale=dim ** -0.5, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
                         lower_bound=-5.0, A_log=a_log, dt_bias=dt_bias, cu_seqlens=cu_dev,
                         cu_seqlens_cpu=cu)[0]

    def fwd_bwd():
        out = forward()
        out.backward(dout)

    t0 = time.time()
    with torch.no_grad():
        forward()
    torch.cuda.synchronize()
    print(f"  first forward (compile + tune) done after {time.time() - t0:.0f} s", flush=True)
    fwd_bwd()
    torch.cuda.synchronize()
    tune_s = time.time() - t0
    with torch.no_grad():
        f = median_ms(forward, 3, 20)
    fb = median_ms(fwd_bwd, 3, 10)
    return f, fb, tune_s


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--shapes", default="varlen,single")
    parser.add_argument("--max-configs", type=int, default=0)
    args = parser.parse_args()
    tuners = limit_autotune(args.max_configs) if args.max_configs > 0 else []
    t0 = time.time()
    from fla.ops.kda import chunk_kda

    print(f"fla imported in {time.time() - t0:.0f} s; {len(tuners)} autotuned kernels wrapped",
          flush=True)

    shapes = {"varlen": ("varlen 4x4096 H64 D128", [4096] * 4),
              "single": ("T8192 1 doc H64 D128", [8192])}
    lines = [f"torch {torch.__version__}, device {torch.cuda.get_device_name(0)}",
             f"{'op':34s} {'shape':22s} {'median ms':>10s}"]
    for key in args.shapes.split(","):
        name, lengths = shapes[key]
        f, fb, tune_s = bench_shape(chunk_kda, lengths)
        lines.append(f"{'FLA chunk_kda fwd':34s} {name:22s} {f:10.3f}")
        lines.append(f"{'FLA chunk_kda fwd+bwd':34s} {name:22s} {fb:10.3f}")
        lines.append(f"  (first calls incl. autotune: {tune_s:.0f} s)")
        print("\n".join(lines[-3:]), flush=True)
    if args.max_configs > 0:
        lines.append(f"autotune limited to {args.max_configs} config(s) per kernel; configs run:")
        for name, kept, total, tuner in tuners:
            best = getattr(tuner, "best_config", None)
            if best is not None:
                lines.append(f"  {name}: {best} ({kept} of {total} configs)")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
