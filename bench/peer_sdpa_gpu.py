#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on a GPU with the flash and the cuDNN backends: the peer columns of
`attn_bench --device cuda`.

    python3 bench/peer_sdpa_gpu.py [--seqs 8192,16384,32768,65536] [--dims 128] [--hq 32] [--hkv 32]
                                   [--masks causal,full] [--no-backward] [--max-reps 20] [--budget 1.0]

For each row prints `S D mask flash_fwd flash_bwd cudnn_fwd cudnn_bwd` in TFLOP/s (`nan`: that backend failed or
refused the row, the reason on stderr), after `#` lines saying what ran. bf16, B = 1, random inputs. FLOPs as
attn_bench counts them: forward 4*B*Hq*S*S*D, halved for causal; backward 2.5x forward. The forward is timed alone;
the backward is `torch.autograd.grad` of the forward's output (kept, with retain_graph) for a random dO, so it runs
the same backend's backward kernel. Each figure is the median of repetitions timed with CUDA events after two
warm-up calls, as many as fit `--budget` seconds (at least 3, at most `--max-reps`), as attn_bench times ours.
Exits with status 2 and a message when torch or a CUDA device is missing.
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
    ap.add_argument("--seqs", default="8192,16384,32768,65536")
    ap.add_argument("--dims", default="128")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=32)
    ap.add_argument("--masks", default="causal,full")
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--max-reps", type=int, default=20)
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timed calls per figure")
    a = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        print(f"peer_sdpa_gpu: no torch with torch.nn.attention ({e})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("peer_sdpa_gpu: torch sees no CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dev = torch.device("cuda")
    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]
    print(f"# PyTorch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name(0)}")
    print(f"# B=1 Hq={a.hq} Hkv={a.hkv} bf16; TFLOP/s: S D mask flash_fwd flash_bwd cudnn_fwd cudnn_bwd")
    for s in [int(x) for x in a.seqs.split(",")]:
        for d in [int(x) for x in a.dims.split(",")]:
            for mask in a.masks.split(","):
                causal = mask == "causal"
                flops = 4.0 * a.hq * s * s * d * (0.5 if causal else 1.0)
                shape_q, shape_kv = (1, a.hq, s, d), (1, a.hkv, s, d)
                q = torch.randn(shape_q, device=dev, dtype=torch.bfloat16, requires_grad=True)
                k = torch.randn(shape_kv, device=dev, dtype=torch.bfloat16, requires_grad=True)
                v = torch.randn(shape_kv, device=dev, dtype=torch.bfloat16, requires_grad=True)
                dout = torch.randn(shape_q, device=dev, dtype=torch.bfloat16)
                gqa = a.hq != a.hkv
                figures = []
                for name, backend in backends:
                    fwd = bwd = float("nan")
                    try:
                        with sdpa_kernel(backend):
                            attn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
                            # With autograd on, as in training: the backend saves what its backward needs.
                            fwd = flops / timed(torch, attn, a.budget, a.max_reps) / 1e12
                            if not a.no_backward:
                                out = attn()
                                back = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                                bwd = 2.5 * flops / timed(torch, back, a.budget, a.max_reps) / 1e12
                                del out
                    except RuntimeError as e:
                        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                        print(f"peer_sdpa_gpu: {name} S={s} D={d} {mask}: {first}", file=sys.stderr)
                    figures += [fwd, bwd]
                print(s, d, mask, *(f"{x:.1f}" for x in figures), flush=True)
                del q, k, v, dout
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
