#!/usr/bin/env python3
"""PyTorch's matrix products on a GPU (cuBLAS) for a linear layer: the peer columns of `linear_bench --device cuda`.

    python3 bench/peer_linear_gpu.py --tokens 16384 --shapes 4096x4096,4096x14336 [--max-reps 20] [--budget 1.0]

For each `INxOUT` shape prints `IN OUT fwd dX dW` in TFLOP/s: `x @ w.t()`, `dy @ w` and `dy.t() @ x` in bf16, the
products of `nn.Linear`'s forward and backward, on random inputs. Each is the median of repetitions timed with CUDA
events after two warm-up calls, as many as fit `--budget` seconds (at least 3, at most `--max-reps`), as
linear_bench times ours. Exits with status 2 and a message when torch or a CUDA device is missing.
"""
import argparse
import statistics
import sys


def timed(torch, fn, budget, max_reps):
    """Median seconds of `fn()`, timed with CUDA events after two warm-up calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def once():
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    once()
    last = once()
    reps = max(3, min(max_reps, int(budget / max(last, 1e-9))))
    return statistics.median(once() for _ in range(reps))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--shapes", default="4096x4096,4096x14336,14336x4096,4096x128256")
    ap.add_argument("--max-reps", type=int, default=20)
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timed calls per figure")
    a = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        print(f"peer_linear_gpu: no torch ({e})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("peer_linear_gpu: torch sees no CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dev = torch.device("cuda")
    print(f"# PyTorch {torch.__version__}, cuBLAS, {torch.cuda.get_device_name(0)}; bf16 TFLOP/s: IN OUT fwd dX dW")
    t = a.tokens
    for shape in a.shapes.split(","):
        d_in, d_out = (int(v) for v in shape.split("x"))
        x = torch.randn(t, d_in, device=dev, dtype=torch.bfloat16)
        w = torch.randn(d_out, d_in, device=dev, dtype=torch.bfloat16) * 0.05
        dy = torch.randn(t, d_out, device=dev, dtype=torch.bfloat16)
        flops = 2.0 * t * d_in * d_out
        rates = [
            flops / timed(torch, f, a.budget, a.max_reps) / 1e12
            for f in (lambda: x @ w.t(), lambda: dy @ w, lambda: dy.t() @ x)
        ]
        print(d_in, d_out, *(f"{r:.1f}" for r in rates), flush=True)
        del x, w, dy
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
