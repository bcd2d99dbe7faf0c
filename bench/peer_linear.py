#!/usr/bin/env python3
"""PyTorch's CPU products for a linear layer, the peer column of `linear_bench`.

    python3 bench/peer_linear.py --tokens 4096 --shapes 256x256,256x688 [--threads N] [--reps N]

For each `INxOUT` shape prints one line `IN OUT fwd dX dW` (GFLOP/s, best of `--reps`): `x @ w.t()`,
`dy @ w` and `dy.t() @ x` in f32, the products of `nn.Linear`'s forward and backward (MKL on x86).
Needs torch; exits with a message (status 0) when it is not installed, so callers can run it unconditionally.
"""
import argparse
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--shapes", default="256x256,256x128,256x688,688x256")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("# peer_linear: torch is not installed; no peer column", file=sys.stderr)
        return 0
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    t = a.tokens
    for shape in a.shapes.split(","):
        d_in, d_out = (int(v) for v in shape.split("x"))
        x = torch.randn(t, d_in)
        w = torch.randn(d_out, d_in)
        dy = torch.randn(t, d_out)
        flops = 2.0 * t * d_in * d_out
        rates = []
        for f in (lambda: x @ w.t(), lambda: dy @ w, lambda: dy.t() @ x):
            best = float("inf")
            for _ in range(a.reps):
                s = time.perf_counter()
                f()
                best = min(best, time.perf_counter() - s)
            rates.append(flops / best / 1e9)
        print(d_in, d_out, *(f"{r:.1f}" for r in rates), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
