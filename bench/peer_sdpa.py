#!/usr/bin/env python3
"""PyTorch CPU scaled_dot_product_attention on the shapes of `attn_bench`, as the peer column.

    python3 bench/peer_sdpa.py [--seqs 1024,4096,16384,32768] [--dims 64,128] [--threads N] [--causal | --full]
                               [--dtypes f32,bf16] [--no-backward] [--reps N] [--rows-only]

Prints the same table columns as `cargo run --release -p longctx-kernels --example attn_bench`
(FLOPs: forward 4*B*H*S*S*D, halved for causal; forward+backward 3.5x forward).
Needs torch; exits with a message (status 0) when it is not installed, so scripts can call it unconditionally.
`attn_bench` runs it one row at a time (`--rows-only`), alternating with its own measurement, when it finds torch.
"""
import argparse
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="1024,4096,16384,32768")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--causal", action="store_true", help="causal mask only")
    ap.add_argument("--full", action="store_true", help="no mask only")
    ap.add_argument("--reps", type=int, default=0, help="timed repetitions per row (default: about 1 s of work)")
    ap.add_argument("--rows-only", action="store_true", help="print the table rows without the header")
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--hq", type=int, default=8, help="query heads")
    ap.add_argument("--hkv", type=int, default=2, help="key/value heads")
    ap.add_argument("--no-backward", action="store_true",
                    help="forward only (PyTorch's CPU bf16 backward takes many minutes at S >= 16384)")
    a = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("# peer_sdpa: torch is not installed; no peer column", file=sys.stderr)
        return 0
    torch.set_num_threads(a.threads)
    B, HQ, HKV = 1, a.hq, a.hkv
    if not a.rows_only:
        print(f"# PyTorch {torch.__version__} CPU SDPA, B={B} Hq={HQ} Hkv={HKV}, {a.threads} threads")
        print("| S | D | mask | dtype | fwd ms | fwd GFLOP/s | fwd+bwd ms | fwd+bwd GFLOP/s |")
        print("|---|---|---|---|---|---|---|---|")
    for s in [int(x) for x in a.seqs.split(",")]:
        for d in [int(x) for x in a.dims.split(",")]:
            for causal in (True,) if a.causal else (False,) if a.full else (True, False):
                for dt in [{"f32": torch.float32, "bf16": torch.bfloat16}[x] for x in a.dtypes.split(",")]:
                    q = torch.randn(B, HQ, s, d, dtype=dt, requires_grad=True)
                    # GQA: repeat KV heads (SDPA's enable_gqa where available).
                    k = torch.randn(B, HKV, s, d, dtype=dt, requires_grad=True)
                    v = torch.randn(B, HKV, s, d, dtype=dt, requires_grad=True)
                    kwargs = {"is_causal": causal}
                    try:
                        F.scaled_dot_product_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], enable_gqa=True)
                        kwargs["enable_gqa"] = True
                        kk, vv = k, v
                    except TypeError:
                        kk = k.repeat_interleave(HQ // HKV, dim=1)
                        vv = v.repeat_interleave(HQ // HKV, dim=1)
                    flops = 4 * B * HQ * s * s * d * (0.5 if causal else 1.0)
                    reps = a.reps if a.reps > 0 else max(1, min(20, int(2e11 / flops)))
                    fwd = float("inf")
                    for _ in range(reps):
                        t = time.perf_counter()
                        with torch.no_grad():
                            F.scaled_dot_product_attention(q, kk, vv, **kwargs)
                        fwd = min(fwd, time.perf_counter() - t)
                    fb = float("inf")
                    for _ in range(0 if a.no_backward else reps):
                        t = time.perf_counter()
                        o = F.scaled_dot_product_attention(q, kk, vv, **kwargs)
                        o.backward(torch.ones_like(o))
                        fb = min(fb, time.perf_counter() - t)
                    name = "f32" if dt == torch.float32 else "bf16"
                    fb_cols = "– | –" if a.no_backward else f"{fb*1e3:.1f} | {3.5*flops/fb/1e9:.1f}"
                    print(f"| {s} | {d} | {'causal' if causal else 'full'} | {name} | {fwd*1e3:.1f} | "
                          f"{flops/fwd/1e9:.1f} | {fb_cols} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
