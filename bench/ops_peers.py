#!/usr/bin/env python3
"""The peers of `glmtune bench ops`: each hot op's best public counterpart, timed in the same run.

`glmtune bench ops` starts this script as a child process before it times its own kernels and
reads the JSON it writes. Each row is keyed like the row of the glmtune table it is paired with
(apps/glmtune/cmd_bench_ops.cpp, bench/ops_common.cpp list the same keys):

  mm ...          torch.mm (cuBLAS) at the step's projection shapes and at 8192^3
  grouped ...     torch._grouped_mm at bench_cuda_moe's expert shapes (grouped_mm_vs_torch.py)
  scaled_mm ...   torch._scaled_mm, block-scaled FP8 (1x128 / 128x128 scales, cuBLASLt on Hopper)
  sdpa ...        torch SDPA, causal, dense, T4096 H64 D256 (grouped_mm_vs_torch.py)
  sdpa ... vision torch SDPA, bidirectional, the vision tower's segments as a batch
  fla ...         FLA chunk_kda, gate / q-k L2 norm / beta sigmoid inside its kernels

Order of work: every peer is first prepared and run once (FLA's Triton kernels compile on first
use, which takes minutes and runs on the CPU while glmtune times its own kernels), then the script
waits for the exclusive lock on `--gpu-lock` (glmtune holds it while it times), and only then times
its rows, so the two never time at the same moment. SIGTERM during the preparation stops it: the
rows that are ready are timed, the others say that they were still compiling.

Without torch, a CUDA device or fla the rows say why (the "error" of the report or of a row); no
row is left out silently. Times are medians of CUDA-event-timed runs after warm-up runs on random
inputs, written to `--out` after every row.

Usage: python3 bench/ops_peers.py --out peers.json [--keys K1,K2,...] [--gpu-lock FILE]
       [--fla-max-configs N] [--time-limit S]
       python3 bench/ops_peers.py --list
"""

import argparse
import fcntl
import json
import os
import platform
import signal
import sys
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
HIDDEN = 4096
TOKENS = 16384

# Dense GEMMs at the step's projection shapes, row-major C[M, N] = op(A) op(B) with A [M, K] and
# B stored [N, K] ("NT", the forward), B stored [K, N] ("NN", dX) or A stored [K, M] ("TN", dW).
MM_SHAPES = [
    ("NT", 8192, 8192, 8192),
    ("NT", TOKENS, 8192, HIDDEN),  # KDA q / k / v projection
    ("NT", TOKENS, HIDDEN, 8192),  # KDA o_proj
    ("NT", TOKENS, 16384, 1536),  # MLA q_b_proj
    ("NT", TOKENS, HIDDEN, 16384),  # MLA o_proj
    ("NT", TOKENS, 24576, HIDDEN),  # dense MLP gate_up
    ("NT", TOKENS, HIDDEN, 12288),  # dense MLP down
    ("NN", TOKENS, HIDDEN, 24576),  # dense MLP gate_up dX
    ("TN", 24576, HIDDEN, TOKENS),  # dense MLP gate_up dW
]
# Block-scaled FP8 GEMMs C[M, N] reducing over K (cmd_bench_ops.cpp's fp8 rows): "fwd" and "dX"
# take 1x128 scales on the [M, K] operand and 128x128 on the [N, K] one; "dW" 1x128 on both (the
# operands are dyᵀ and xᵀ, contiguous along the tokens).
SCALED_MM_SHAPES = [
    ("fwd", TOKENS, 8192, HIDDEN),
    ("fwd", TOKENS, 24576, HIDDEN),
    ("fwd", TOKENS, HIDDEN, 12288),
    ("dX", TOKENS, HIDDEN, 24576),
    ("dW", 24576, HIDDEN, TOKENS),
]
GROUPED = [(rows, name, n, k) for rows in (910, 3641)
           for name, n, k in (("gate_up", 4096, 4096), ("down", 4096, 2048))]
KDA_SHAPES = {"varlen 4x4096 H64 D128": [4096] * 4, "T16384 1 doc H64 D128": [16384]}
SDPA_SHAPE = "T4096 H64 D256 causal"
# The vision tower's attention: (segments, rows per segment), 16 heads of 64, no mask.
VISION_SHAPES = {"16x1024 H16 D64": (16, 1024), "1x16384 H16 D64": (1, 16384)}


def mm_key(layout, m, n, k):
    return f"mm {layout} M{m} N{n} K{k}"


def scaled_mm_key(which, m, n, k):
    return f"scaled_mm {which} M{m} N{n} K{k}"


def grouped_key(rows, name, which, n, k):
    return f"grouped {name} {which} 36x{rows} N{n} K{k}"


def all_keys():
    """(key, peer) of every row this script can time."""
    keys = [(mm_key(*s), "torch.mm") for s in MM_SHAPES]
    keys += [(scaled_mm_key(*s), "torch._scaled_mm") for s in SCALED_MM_SHAPES]
    keys += [(grouped_key(r, name, which, n, k), "torch._grouped_mm")
             for r, name, n, k in GROUPED for which in ("fwd", "dX", "dW")]
    keys += [(f"sdpa {which} {SDPA_SHAPE}", "torch SDPA") for which in ("fwd", "fwd+bwd")]
    keys += [(f"sdpa {which} vision {shape}", "torch SDPA")
             for shape in VISION_SHAPES for which in ("fwd", "fwd+bwd")]
    keys += [(f"fla {which} {shape}", "FLA chunk_kda")
             for shape in KDA_SHAPES for which in ("fwd", "fwd+bwd")]
    return keys


class StopPreparing(BaseException):
    """Raised by SIGTERM while peers are still being prepared (a BaseException, so that no
    `except Exception` inside Triton or FLA swallows it)."""


class Report:
    """The JSON report, rewritten whole after every change (write, then rename)."""

    def __init__(self, path, wanted):
        self.path = path
        self.data = {"status": "starting", "python": platform.python_version(), "notes": [],
                     "rows": []}
        self.wanted = wanted

    def write(self):
        if not self.path:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(self.data, fh, indent=1)
        os.replace(tmp, self.path)

    def set(self, **fields):
        self.data.update(fields)
        self.write()

    def note(self, text):
        print(f"ops_peers: {text}", file=sys.stderr, flush=True)
        self.data["notes"].append(text)
        self.write()

    def row(self, key, peer, ms=None, error=None):
        if key not in self.wanted:
            return
        entry = {"key": key, "peer": peer}
        if error is None:
            entry["ms"] = ms
            print(f"ops_peers: {key:<48} {ms:10.3f} ms", file=sys.stderr, flush=True)
        else:
            entry["error"] = error
        self.data["rows"].append(entry)
        self.write()


class MmPeers:
    name = "torch.mm"

    def __init__(self, wanted):
        self.shapes = [s for s in MM_SHAPES if mm_key(*s) in wanted]

    def keys(self):
        return [mm_key(*s) for s in self.shapes]

    def prepare(self, torch, report):
        def operands(layout, m, n, k):
            gen = torch.Generator(device="cuda").manual_seed(20261129)
            a_shape = (k, m) if layout == "TN" else (m, k)
            b_shape = (n, k) if layout == "NT" else (k, n)
            a = torch.randn(*a_shape, device="cuda", generator=gen).to(torch.bfloat16)
            b = (torch.randn(*b_shape, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
            a_op = a.t() if layout == "TN" else a
            b_op = b.t() if layout == "NT" else b
            return lambda: torch.mm(a_op, b_op)

        self.calls = [(s, operands(*s)) for s in self.shapes]
        for _, call in self.calls:
            call()

    def time(self, torch, median_ms, report):
        for shape, call in self.calls:
            report.row(mm_key(*shape), self.name, median_ms(call, 3, 20))
        self.calls = []
        torch.cuda.empty_cache()


class ScaledMmPeers:
    """torch._scaled_mm with DeepSeek-style block scales: the [M, K] operand in 1x128 tiles and the
    [N, K] one in 128x128 blocks ("dW": 1x128 on both), scales laid out as torch documents them
    (M-major 1x128 scales; 128x128 scales with the K blocks padded to a multiple of 4). Where this
    torch refuses block-wise scales, the row is timed with row-wise scales instead and a note says
    so. Values are random e4m3 codes, scales random in [0.5, 1.5): the time does not depend on
    them."""

    name = "torch._scaled_mm"

    def __init__(self, wanted):
        self.shapes = [s for s in SCALED_MM_SHAPES if scaled_mm_key(*s) in wanted]

    def keys(self):
        return [scaled_mm_key(*s) for s in self.shapes]

    @staticmethod
    def call(torch, which, m, n, k):
        gen = torch.Generator(device="cuda").manual_seed(20261210)
        f8 = torch.float8_e4m3fn
        a = torch.randn(m, k, device="cuda", generator=gen).to(f8)
        b = torch.randn(n, k, device="cuda", generator=gen).to(f8)
        kb = -(-k // 128)
        kb4 = -(-kb // 4) * 4

        def rnd(*shape):
            return torch.rand(*shape, device="cuda", generator=gen) + 0.5

        scale_a = rnd(kb, m).t()  # [M, K/128], M-major
        if which == "dW":
            scale_b = rnd(kb, n).t()  # [N, K/128], N-major
            candidates = [scale_b, scale_b.t()]  # torch versions differ in which they expect
        else:
            scale_b = rnd(-(-n // 128), kb4).t()[:kb]  # [K/128, N/128], the K blocks fastest
            candidates = [scale_b]
        errors = []
        for sb in candidates:
            fn = lambda sb=sb: torch._scaled_mm(a, b.t(), scale_a, sb, out_dtype=torch.bfloat16)
            try:
                fn()
                return fn, None
            except (RuntimeError, ValueError) as err:
                errors.append(str(err).splitlines()[0])
        row_a, row_b = rnd(m, 1), rnd(1, n)
        fn = lambda: torch._scaled_mm(a, b.t(), row_a, row_b, out_dtype=torch.bfloat16)
        fn()
        return fn, "; ".join(errors)

    def prepare(self, torch, report):
        self.calls = []
        for shape in self.shapes:
            fn, refused = self.call(torch, *shape)
            if refused:
                report.note(f"torch {torch.__version__} refused block-wise scales at "
                            f"{scaled_mm_key(*shape)} ({refused}): timed with row-wise scales")
            self.calls.append((shape, fn))

    def time(self, torch, median_ms, report):
        for shape, fn in self.calls:
            report.row(scaled_mm_key(*shape), self.name, median_ms(fn, 3, 20))
        self.calls = []
        torch.cuda.empty_cache()


class GroupedPeers:
    """torch._grouped_mm through grouped_mm_vs_torch.grouped (which also prepares its operands)."""

    name = "torch._grouped_mm"

    def __init__(self, wanted):
        self.families = [g for g in GROUPED
                         if any(grouped_key(*g[:2], w, *g[2:]) in wanted
                                for w in ("fwd", "dX", "dW"))]

    def keys(self):
        return [grouped_key(rows, name, which, n, k) for rows, name, n, k in self.families
                for which in ("fwd", "dX", "dW")]

    def prepare(self, torch, report):
        pass

    def time(self, torch, median_ms, report):
        import grouped_mm_vs_torch

        for rows, name, n, k in self.families:
            timed = []
            grouped_mm_vs_torch.grouped(timed, name, rows, n, k)
            for r in timed:
                which = r["op"].split()[1]
                report.row(grouped_key(rows, name, which, n, k), self.name, r["ms"])
        torch.cuda.empty_cache()


class SdpaPeers:
    """torch SDPA, causal and dense, through grouped_mm_vs_torch.sdpa."""

    name = "torch SDPA"

    def __init__(self, wanted):
        self.wanted_keys = [k for k in (f"sdpa fwd {SDPA_SHAPE}", f"sdpa fwd+bwd {SDPA_SHAPE}")
                            if k in wanted]

    def keys(self):
        return self.wanted_keys

    def prepare(self, torch, report):
        pass

    def time(self, torch, median_ms, report):
        import grouped_mm_vs_torch

        if not self.wanted_keys:
            return
        timed = []
        try:
            grouped_mm_vs_torch.sdpa(timed, 4096, 64, 256)
        except RuntimeError as err:
            for key in self.wanted_keys:
                report.row(key, self.name, error=f"torch SDPA failed at {SDPA_SHAPE}: {err}")
            return
        for r in timed:
            which = "fwd+bwd" if r["op"].endswith("fwd+bwd") else "fwd"
            report.row(f"sdpa {which} {SDPA_SHAPE}", self.name, r["ms"])
        torch.cuda.empty_cache()


class VisionSdpaPeers:
    """torch SDPA without a mask over equal segments given as the batch: the same function as the
    vision tower's attention over a pack of equal images."""

    name = "torch SDPA"

    def __init__(self, wanted):
        self.wanted = wanted
        self.shapes = [s for s in VISION_SHAPES
                       if any(f"sdpa {w} vision {s}" in wanted for w in ("fwd", "fwd+bwd"))]

    def keys(self):
        return [f"sdpa {w} vision {s}" for s in self.shapes for w in ("fwd", "fwd+bwd")
                if f"sdpa {w} vision {s}" in self.wanted]

    def prepare(self, torch, report):
        pass

    def time(self, torch, median_ms, report):
        sdpa = torch.nn.functional.scaled_dot_product_attention
        for shape in self.shapes:
            segments, rows = VISION_SHAPES[shape]
            gen = torch.Generator(device="cuda").manual_seed(20261204)
            q, k, v = (torch.randn(segments, 16, rows, 64, device="cuda", generator=gen)
                       .to(torch.bfloat16).requires_grad_() for _ in range(3))
            dout = torch.randn(segments, 16, rows, 64, device="cuda", generator=gen).to(
                torch.bfloat16)

            def fwd_bwd():
                q.grad = k.grad = v.grad = None
                sdpa(q, k, v).backward(dout)

            calls = {"fwd": lambda: sdpa(q, k, v), "fwd+bwd": fwd_bwd}
            for which, call in calls.items():
                key = f"sdpa {which} vision {shape}"
                if key in self.wanted:
                    report.row(key, self.name, median_ms(call, 3, 10))
            del q, k, v, dout
            torch.cuda.empty_cache()


class FlaPeers:
    """FLA chunk_kda from the same raw inputs as glmtune's row: q, k (L2-normalised inside), v, the
    raw gate with A_log and dt_bias (lower bound -5), beta logits; bf16, 64 heads of 128. Both
    shapes pass cu_seqlens, so the single document runs the same compiled kernels."""

    name = "FLA chunk_kda"

    def __init__(self, wanted, max_configs):
        self.shapes = {shape: lengths for shape, lengths in KDA_SHAPES.items()
                       if any(f"fla {w} {shape}" in wanted for w in ("fwd", "fwd+bwd"))}
        self.max_configs = max_configs
        self.ready = {}

    def keys(self):
        return [f"fla {which} {shape}" for shape in self.shapes for which in ("fwd", "fwd+bwd")]

    def prepare(self, torch, report):
        if not self.shapes:
            return
        tuners = []
        if self.max_configs > 0:
            from kda_vs_fla import limit_autotune

            tuners = limit_autotune(self.max_configs)
        try:
            import fla
            from fla.ops.kda import chunk_kda
        except ImportError as err:
            self.error = (f"fla is not importable ({err}): install fla-core (pip install fla-core, "
                          "or carry its wheel)")
            return
        report.note(f"fla {getattr(fla, '__version__', '?')}; autotune "
                    + (f"limited to {self.max_configs} config(s) per kernel "
                       f"({len(tuners)} kernels), so FLA's times bound its tuned times from above"
                       if self.max_configs > 0 else "over every config"))
        for shape, lengths in self.shapes.items():
            start = time.time()
            forward, fwd_bwd = self.inputs(torch, chunk_kda, lengths)
            with torch.no_grad():
                forward()
            torch.cuda.synchronize()
            fwd_s = time.time() - start
            fwd_bwd()
            torch.cuda.synchronize()
            self.ready[shape] = forward, fwd_bwd
            report.note(f"FLA {shape}: first forward {fwd_s:.0f} s, first forward+backward "
                        f"{time.time() - start - fwd_s:.0f} s more (Triton compilation)")

    @staticmethod
    def inputs(torch, chunk_kda, lengths, heads=64, dim=128):
        total = sum(lengths)
        gen = torch.Generator(device="cuda").manual_seed(20261129)

        def rnd(*shape, std=1.0):
            return (torch.randn(*shape, device="cuda", generator=gen) * std).to(torch.bfloat16)

        q, k, v, g = (rnd(1, total, heads, dim).requires_grad_() for _ in range(4))
        beta = rnd(1, total, heads).requires_grad_()
        a_log = (torch.randn(heads, device="cuda", generator=gen) * 0.5).requires_grad_()
        dt_bias = (torch.randn(heads * dim, device="cuda", generator=gen) * 0.5).requires_grad_()
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.long)
        cu_dev = cu.to("cuda")
        dout = rnd(1, total, heads, dim)

        def forward():
            return chunk_kda(q, k, v, g, beta, scale=dim**-0.5, use_qk_l2norm_in_kernel=True,
                             use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                             safe_gate=True, lower_bound=-5.0, A_log=a_log, dt_bias=dt_bias,
                             cu_seqlens=cu_dev, cu_seqlens_cpu=cu)[0]

        leaves = (q, k, v, g, beta, a_log, dt_bias)

        def fwd_bwd():
            # Fresh gradients each run, as glmtune's backward writes them (no accumulation adds).
            for leaf in leaves:
                leaf.grad = None
            forward().backward(dout)

        return forward, fwd_bwd

    def time(self, torch, median_ms, report, stopped_because=None):
        for shape in self.shapes:
            for which in ("fwd", "fwd+bwd"):
                key = f"fla {which} {shape}"
                if shape not in self.ready:
                    why = getattr(self, "error", None) or stopped_because or "not prepared"
                    report.row(key, self.name, error=why)
                    continue
                forward, fwd_bwd = self.ready[shape]
                if which == "fwd":
                    with torch.no_grad():
                        ms = median_ms(forward, 3, 20)
                else:
                    ms = median_ms(fwd_bwd, 3, 10)
                report.row(key, self.name, ms)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="the JSON report (rewritten after each row)")
    parser.add_argument("--keys", default=None, help="comma-separated row keys (default: all)")
    parser.add_argument("--gpu-lock", default=None,
                        help="a file whose exclusive lock glmtune holds while it times")
    parser.add_argument("--fla-max-configs", type=int, default=1,
                        help="autotune configs kept per FLA kernel (0 = all; see kda_vs_fla.py)")
    parser.add_argument("--time-limit", type=float, default=0,
                        help="the caller's limit in seconds, named in the rows it cuts short")
    parser.add_argument("--list", action="store_true", help="print the row keys as JSON and exit")
    args = parser.parse_args()
    if args.list:
        print(json.dumps([{"key": k, "peer": p} for k, p in all_keys()]))
        return 0

    known = dict(all_keys())
    wanted = set(known) if args.keys is None else set(filter(None, args.keys.split(",")))
    unknown = sorted(wanted - set(known))
    if unknown:
        parser.error(f"unknown --keys {unknown}; --list prints the known ones")
    report = Report(args.out, wanted)
    report.write()

    def fail(message):
        report.set(status="error", error=message)
        print(f"ops_peers: {message}", file=sys.stderr, flush=True)
        return 0

    try:
        import torch
    except ImportError as err:
        return fail(f"torch is not importable by {sys.executable} ({err}): pass --python with "
                    "the interpreter that has torch")
    if not torch.cuda.is_available():
        return fail(f"torch {torch.__version__} sees no CUDA device")
    sys.path.insert(0, BENCH_DIR)
    from grouped_mm_vs_torch import median_ms

    report.set(status="preparing", torch=torch.__version__,
               device=torch.cuda.get_device_name(0))
    groups = [MmPeers(wanted), ScaledMmPeers(wanted), GroupedPeers(wanted), SdpaPeers(wanted), VisionSdpaPeers(wanted),
              FlaPeers(wanted, args.fla_max_configs)]

    def on_term(signum, frame):
        raise StopPreparing()

    signal.signal(signal.SIGTERM, on_term)
    start = time.time()
    stopped_because = None
    prepared, failed = [], {}
    try:
        for group in groups:
            try:
                group.prepare(torch, report)
                prepared.append(group)
            except Exception as err:  # its rows say so; the other peers still run
                failed[group] = f"{group.name} failed while preparing: {err!r}"
    except StopPreparing:
        limit = f" ({args.time_limit:.0f} s)" if args.time_limit else ""
        stopped_because = (f"still preparing when the peer time limit{limit} ran out (FLA's "
                           "Triton kernels compile on first use): raise --peer-timeout")
    # From here on the rows are timed and written one by one; glmtune ends a late peer itself.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.cuda.synchronize()
    report.note(f"peers prepared in {time.time() - start:.0f} s")

    lock = None
    if args.gpu_lock:
        report.set(status="waiting for the GPU")
        lock = open(args.gpu_lock, "a")
        fcntl.flock(lock, fcntl.LOCK_EX)
    report.set(status="timing")
    for group in groups:
        try:
            if group in failed:
                raise RuntimeError(failed[group])
            if isinstance(group, FlaPeers):
                group.time(torch, median_ms, report, stopped_because)
            elif group in prepared:
                group.time(torch, median_ms, report)
            else:
                for key in group.keys():
                    report.row(key, group.name, error=stopped_because)
        except Exception as err:
            done = {row["key"] for row in report.data["rows"]}
            for key in group.keys():
                if key not in done:
                    report.row(key, group.name, error=str(err))
    if lock:
        lock.close()
    report.set(status="done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
