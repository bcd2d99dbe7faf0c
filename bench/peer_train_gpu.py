#!/usr/bin/env python3
"""Hugging Face transformers training on a GPU: the peer columns of `longctx bench --device cuda:N`.

    python3 bench/peer_train_gpu.py --seq 16384 [--steps 2] [--device cuda[:N]|cpu]
                                    [--layers 4 --d-model 4096 --heads 32 --kv-heads 8 --ffn 14336
                                     --vocab 128256 --theta 500000] [--sdpa-backend default|flash|cudnn|efficient|math]

The model is transformers' `LlamaForCausalLM` built from a `LlamaConfig` (nothing downloaded: random weights,
`torch.manual_seed(1234)`), by default the Llama 3 8B shape cut to 4 layers: hidden 4096, 32 query / 8 key-value
heads (head dim 128), SwiGLU 14336, a 128,256-token vocabulary, plain RoPE of base 500000 (no Llama 3.1 scaling),
RMSNorm eps 1e-5, untied embeddings: 1.92 B parameters. Each size can be changed by its flag, so a tiny model can
be smoke-tested. Attention is `attn_implementation="sdpa"` (PyTorch's `scaled_dot_product_attention`, its own
choice of backend unless `--sdpa-backend` names one); no KV cache.

Training is what a user of transformers writes: fp32 master weights, the forward and the loss under
`torch.autocast("cuda", dtype=torch.bfloat16)`, `torch.optim.AdamW(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
fused=True)`, gradient clipping at 1.0, batch 1. The tokens are `longctx bench`'s corpus read as
bench/peer_train.py reads it (the bytes of trainer-ref/data/jargon.txt.gz as token ids; step i takes the window of
seq + 1 tokens at (i * seq) mod (len - seq - 1)): the first seq are the input, the next token of each is its label,
and the model computes the loss (`labels=`; with `shift_labels=` where transformers takes it, so all seq positions
count, as in longctx; older transformers shift the labels themselves and the last position goes unscored).

`--device cpu` runs the same on the CPU (autocast on the CPU, AdamW without `fused`): for smoke tests only.

One untimed warm-up step, then `--steps` timed steps between two `torch.cuda.synchronize()`. Prints one JSON line
on stdout at the end:

    seq                the sequence length (tokens per step)
    tokens_per_s       seq * steps over the timed steps' wall time
    step_s             seconds per timed step
    peak_alloc_mib     torch.cuda.max_memory_allocated() / 2^20 over the whole run (tensors alive at the peak;
                       null on the CPU)
    peak_reserved_mib  torch.cuda.max_memory_reserved() / 2^20 (what the caching allocator held; null on the CPU)
    peak_rss_mib       the process's peak resident memory on the host, MiB
    loss_first         the warm-up step's loss (nats per token)
    loss_last          the last timed step's loss
    params             the model's parameter count
    loss_positions     positions scored per step (seq, or seq - 1 where transformers shifts the labels itself)
    attn               the attention implementation transformers chose ("sdpa")
    peer, device       transformers and torch versions; the device's name
    status             "ok"

A run out of device memory (`torch.cuda.OutOfMemoryError`, or a library's RuntimeError saying "out of memory") is
caught, its memory freed, and reported as
`{"seq": .., "status": "oom", "peak_alloc_mib": .., "peak_reserved_mib": .., "detail": "..."}` with exit status 0.
When torch or transformers cannot be imported it prints a message on stderr, no JSON, and exits with status 0 (as
bench/peer_train.py does), so the bench prints no peer column. Model FLOPs and MFU are computed by `longctx bench`,
not here.
"""
import argparse
import gc
import gzip
import inspect
import json
import os
import resource
import sys
import time

SEED = 1234


def parse_args():
    ap = argparse.ArgumentParser(description="transformers LlamaForCausalLM training: longctx bench's GPU peer")
    ap.add_argument("--seq", type=int, default=16384, help="tokens per step (batch 1)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps, after one untimed warm-up step")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (smoke tests only)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--theta", type=float, default=500000.0)
    ap.add_argument(
        "--sdpa-backend",
        default="default",
        choices=["default", "flash", "cudnn", "efficient", "math"],
        help="force one scaled_dot_product_attention backend (default: PyTorch's own choice)",
    )
    a = ap.parse_args()
    if a.seq < 1 or a.steps < 1:
        ap.error("--seq and --steps must be at least 1")
    if a.d_model % a.heads or a.heads % a.kv_heads:
        ap.error("--d-model must be a multiple of --heads, and --heads of --kv-heads")
    if not (a.device == "cpu" or a.device == "cuda" or a.device.startswith("cuda:")):
        ap.error(f"--device {a.device}: cuda, cuda:N or cpu")
    return a


def read_corpus(torch):
    """The corpus's bytes as token ids (int64), as bench/peer_train.py reads them."""
    here = os.path.dirname(os.path.abspath(__file__))
    with gzip.open(os.path.join(here, "..", "trainer-ref", "data", "jargon.txt.gz"), "rb") as f:
        raw = f.read()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.long)


def llama_config(transformers, a):
    """The LlamaConfig of the flags. transformers 5 keeps RoPE's base in `rope_parameters` (and still takes the
    older `rope_theta` keyword); 4.x has `rope_theta`. The base is read back, so a version that dropped the value
    fails here rather than training another model."""
    common = dict(
        vocab_size=a.vocab,
        hidden_size=a.d_model,
        intermediate_size=a.ffn,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.d_model // a.heads,
        hidden_act="silu",
        max_position_embeddings=max(a.seq, 8192),
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        use_cache=False,
        # Byte tokens: the special ids only need to lie inside the vocabulary.
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    fields = getattr(transformers.LlamaConfig, "__dataclass_fields__", {})
    if "rope_parameters" in fields:
        cfg = transformers.LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": a.theta})
    else:
        cfg = transformers.LlamaConfig(**common, rope_theta=a.theta, rope_scaling=None)
    params = getattr(cfg, "rope_parameters", None)
    theta = params.get("rope_theta") if isinstance(params, dict) else getattr(cfg, "rope_theta", None)
    if theta is None or float(theta) != a.theta:
        raise RuntimeError(f"LlamaConfig holds RoPE base {theta!r}, not --theta {a.theta}")
    scaling = params.get("rope_type", "default") if isinstance(params, dict) else None
    if scaling not in (None, "default"):
        raise RuntimeError(f"LlamaConfig holds RoPE scaling {scaling!r}; the bench model has none")
    cfg._attn_implementation = "sdpa"
    return cfg


def takes_shift_labels(transformers):
    """Whether this transformers' causal-LM loss takes `shift_labels` (labels already aligned with the logits)."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return False
    return "shift_labels" in inspect.signature(ForCausalLMLoss).parameters


def sdpa_context(torch, name):
    """A context forcing one SDPA backend, or none."""
    import contextlib

    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]
    return sdpa_kernel([backend])


def train(torch, transformers, a, dev, on_cuda, result):
    """Builds the model and times the steps, filling `result`; raises what the run raises (OOM included)."""
    data = read_corpus(torch)
    if len(data) < a.seq + 2:
        raise ValueError(f"--seq {a.seq}: the corpus has {len(data)} tokens, fewer than one window plus its label")
    cfg = llama_config(transformers, a)
    torch.manual_seed(SEED)
    # Built on the device: initialising 1.9 B weights on the CPU first would take longer than the steps.
    with dev:
        model = transformers.LlamaForCausalLM(cfg)
    model.to(device=dev, dtype=torch.float32)
    model.train()
    result["params"] = sum(p.numel() for p in model.parameters())
    # What transformers dispatches attention to (it may fall back from what the config asked for).
    result["attn"] = getattr(model.config, "_attn_implementation", None)
    opt_args = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    if on_cuda:
        opt_args["fused"] = True
    opt = torch.optim.AdamW(model.parameters(), **opt_args)
    shift = takes_shift_labels(transformers)
    result["loss_positions"] = a.seq if shift else a.seq - 1
    amp = torch.autocast(dev.type, dtype=torch.bfloat16)

    def step(i):
        start = (i * a.seq) % (len(data) - a.seq - 1)
        window = data[start:start + a.seq + 1].to(dev, non_blocking=True).view(1, -1)
        ids = window[:, :-1]
        opt.zero_grad(set_to_none=True)
        with amp, sdpa_context(torch, a.sdpa_backend):
            if shift:
                out = model(input_ids=ids, labels=ids, shift_labels=window[:, 1:].contiguous())
            else:
                out = model(input_ids=ids, labels=ids)
        loss = out.loss
        del out  # the logits: freed before the backward allocates their gradient
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.detach()

    def sync():
        if on_cuda:
            torch.cuda.synchronize(dev)

    result["loss_first"] = step(0).item()
    sync()
    t = time.perf_counter()
    # The losses stay on the device until the clock stops: `.item()` each step would add a synchronisation.
    losses = [step(i) for i in range(1, a.steps + 1)]
    sync()
    dt = time.perf_counter() - t
    result["loss_last"] = losses[-1].item()
    result["tokens_per_s"] = a.steps * a.seq / dt
    result["step_s"] = dt / a.steps


def main():
    a = parse_args()
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"# peer_train_gpu: torch or transformers cannot be imported ({e}); no peer column", file=sys.stderr)
        return 0
    dev = torch.device(a.device)
    on_cuda = dev.type == "cuda"
    if on_cuda:
        if not torch.cuda.is_available():
            print("# peer_train_gpu: torch sees no CUDA device; no peer column", file=sys.stderr)
            return 0
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)

    def mib(f):
        return f(dev) / 2**20 if on_cuda else None

    result = {"seq": a.seq}
    detail = None
    try:
        train(torch, transformers, a, dev, on_cuda, result)
    except RuntimeError as e:
        # torch.cuda.OutOfMemoryError from the caching allocator; a library's own allocation (cuBLAS, cuDNN) that
        # fails says "out of memory" in a plain RuntimeError.
        text = str(e).strip()
        if not on_cuda or not ((oom_type is not None and isinstance(e, oom_type)) or "out of memory" in text):
            raise
        # Only the message is kept: the exception's traceback holds the frames, and they the tensors.
        detail = text.splitlines()[0][:300] if text else "CUDA out of memory"
    if detail is not None:
        peak_alloc, peak_reserved = mib(torch.cuda.max_memory_allocated), mib(torch.cuda.max_memory_reserved)
        gc.collect()
        try:
            torch.cuda.empty_cache()
        except RuntimeError:
            pass  # a context a failed library call left unusable frees nothing more; the report still stands
        print(json.dumps({
            "seq": a.seq, "status": "oom", "peak_alloc_mib": peak_alloc, "peak_reserved_mib": peak_reserved,
            "detail": detail,
        }))
        return 0
    result.update({
        "peak_alloc_mib": mib(torch.cuda.max_memory_allocated),
        "peak_reserved_mib": mib(torch.cuda.max_memory_reserved),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peer": f"transformers {transformers.__version__} LlamaForCausalLM, torch {torch.__version__} eager",
        "device": torch.cuda.get_device_name(dev) if on_cuda else "cpu",
        "status": "ok",
    })
    order = ["seq", "tokens_per_s", "step_s", "peak_alloc_mib", "peak_reserved_mib", "peak_rss_mib", "loss_first",
             "loss_last", "params", "loss_positions", "attn", "peer", "device", "status"]
    print(json.dumps({k: result[k] for k in order}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
