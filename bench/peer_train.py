#!/usr/bin/env python3
"""PyTorch eager CPU training of the same tiny model as `longctx bench`: the peer column of the trainer's table.

    python3 bench/peer_train.py --seq 4096 [--steps 3] [--layers 4 --d-model 256 --heads 4 --kv-heads 2
                                [--ffn 688] [--vocab 257] [--threads N] [--dtype f32|bf16]
                                [--family llama|mixtral|nemotron --theta T --experts E --top-k K --aux-coef A
                                 --rotary-factor F]

The model is the trainer's: RMSNorm (eps 1e-5), RoPE rotating pairs (i, i + D/2) with Llama 3 scaling, GQA
through `scaled_dot_product_attention(is_causal=True, enable_gqa=True)` (PyTorch's flash CPU kernel), SwiGLU,
untied embeddings, cross-entropy over the whole sequence's logits, AdamW (betas 0.9/0.95, wd 0.1), gradient
clipping at 1.0; batch 1; tokens from the same corpus (trainer-ref/data/jargon.txt.gz). bf16 runs the forward
under `torch.autocast("cpu", torch.bfloat16)` with f32 weights, PyTorch's usual CPU mixed precision.

`--family mixtral`: the MLP is Hugging Face's `MixtralSparseMoeBlock` written plainly (router softmax over all
experts, top-k, renormalised; a Python loop over experts with `index_add_`), plus `load_balancing_loss_func`
over every layer's router logits times `--aux-coef`; plain RoPE of base `--theta`. `--family nemotron`: LayerNorm
with weight + 1 and bias (`NemotronLayerNorm1P`), RoPE on the first `head_dim · --rotary-factor` dims, and
`down(relu(up(h))²)`.

Prints one JSON line: tokens/s over the timed steps (after one untimed warm-up step), peak RSS (MiB), and the
first and last losses. Exits with status 0 and a message on stderr when torch is not installed.
"""
import argparse
import gzip
import json
import math
import os
import resource
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=688)
    ap.add_argument("--vocab", type=int, default=257)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--family", default="llama", choices=["llama", "mixtral", "nemotron"])
    ap.add_argument("--theta", type=float, default=None)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--aux-coef", type=float, default=0.02)
    ap.add_argument("--rotary-factor", type=float, default=1.0)
    a = ap.parse_args()
    try:
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
    except ImportError:
        print("# peer_train: torch is not installed; no peer column", file=sys.stderr)
        return 0
    torch.set_num_threads(a.threads)
    torch.manual_seed(1234)
    D = a.d_model // a.heads
    R = int(D * a.rotary_factor) if a.family == "nemotron" else D

    def inv_freq():
        if a.family != "llama":
            return 1.0 / (a.theta ** (torch.arange(0, R, 2, dtype=torch.float64) / R))
        base, factor, low, high, orig = 500000.0, 8.0, 1.0, 4.0, 256.0
        inv = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > orig / low, inv / factor, inv)
        smooth = (orig / wavelen - low) / (high - low)
        medium = (wavelen <= orig / low) & (wavelen >= orig / high)
        return torch.where(medium, (1 - smooth) * inv / factor + smooth * inv, scaled)

    pos = torch.arange(a.seq, dtype=torch.float64)
    ang = torch.outer(pos, inv_freq())
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()

    def rope(x):  # x [1, H, S, D]: the first R dims rotate (pairs (i, i + R/2)), the rest pass through
        xr, rest = x[..., :R], x[..., R:]
        x1, x2 = xr[..., : R // 2], xr[..., R // 2:]
        return torch.cat([xr * cos + torch.cat([-x2, x1], -1) * sin, rest], -1)

    class LayerNorm1P(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(c))
            self.bias = nn.Parameter(torch.zeros(c))

        def forward(self, x):
            return F.layer_norm(x, (x.shape[-1],), self.weight + 1, self.bias, 1e-5)

    def norm(c):
        return LayerNorm1P(c) if a.family == "nemotron" else nn.RMSNorm(c, eps=1e-5)

    router_logits = []

    class Moe(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.gate = nn.Linear(c, a.experts, bias=False)
            self.w1 = nn.ModuleList([nn.Linear(c, a.ffn, bias=False) for _ in range(a.experts)])
            self.w3 = nn.ModuleList([nn.Linear(c, a.ffn, bias=False) for _ in range(a.experts)])
            self.w2 = nn.ModuleList([nn.Linear(a.ffn, c, bias=False) for _ in range(a.experts)])

        def forward(self, h):
            x = h.view(-1, h.shape[-1])
            logits = self.gate(x)
            router_logits.append(logits)
            w = F.softmax(logits, dim=1, dtype=torch.float)
            w, sel = torch.topk(w, a.top_k, dim=-1)
            w = (w / w.sum(dim=-1, keepdim=True)).to(x.dtype)
            out = torch.zeros_like(x)
            for e in range(a.experts):
                tok, slot = torch.where(sel == e)
                if tok.numel() == 0:
                    continue
                xe = x[tok]
                y = self.w2[e](F.silu(self.w1[e](xe)) * self.w3[e](xe)) * w[tok, slot, None]
                out.index_add_(0, tok, y.to(x.dtype))
            return out.view_as(h)

    def aux_loss():
        logits = torch.cat(router_logits, 0)
        p = F.softmax(logits, dim=-1, dtype=torch.float)
        _, sel = torch.topk(p, a.top_k, dim=-1)
        mask = F.one_hot(sel, a.experts).float()
        return a.experts * torch.sum(mask.mean(0) * p.mean(0).unsqueeze(0))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            c = a.d_model
            self.n1 = norm(c)
            self.q = nn.Linear(c, a.heads * D, bias=False)
            self.k = nn.Linear(c, a.kv_heads * D, bias=False)
            self.v = nn.Linear(c, a.kv_heads * D, bias=False)
            self.o = nn.Linear(a.heads * D, c, bias=False)
            self.n2 = norm(c)
            if a.family == "mixtral":
                self.moe = Moe(c)
            else:
                self.up = nn.Linear(c, a.ffn, bias=False)
                self.down = nn.Linear(a.ffn, c, bias=False)
            if a.family == "llama":
                self.gate = nn.Linear(c, a.ffn, bias=False)

        def forward(self, x):
            s = x.shape[1]
            h = self.n1(x)
            q = self.q(h).view(1, s, a.heads, D).transpose(1, 2)
            k = self.k(h).view(1, s, a.kv_heads, D).transpose(1, 2)
            v = self.v(h).view(1, s, a.kv_heads, D).transpose(1, 2)
            o = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True, enable_gqa=True)
            x = x + self.o(o.transpose(1, 2).reshape(1, s, a.heads * D))
            h = self.n2(x)
            if a.family == "mixtral":
                return x + self.moe(h)
            if a.family == "nemotron":
                return x + self.down(torch.relu(self.up(h)) ** 2)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(a.vocab, a.d_model)
            self.layers = nn.ModuleList([Layer() for _ in range(a.layers)])
            self.norm = norm(a.d_model)
            self.head = nn.Linear(a.d_model, a.vocab, bias=False)

        def forward(self, ids, targets):
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x)
            logits = self.head(self.norm(x)).float()
            loss = F.cross_entropy(logits.view(-1, a.vocab), targets.view(-1))
            if a.family == "mixtral":
                loss = loss + a.aux_coef * aux_loss()
                router_logits.clear()
            return loss

    model = Llama()
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.normal_(p, std=0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    here = os.path.dirname(os.path.abspath(__file__))
    with gzip.open(os.path.join(here, "..", "trainer-ref", "data", "jargon.txt.gz"), "rb") as f:
        data = torch.tensor(list(f.read()), dtype=torch.long)

    def step(i):
        start = (i * a.seq) % (len(data) - a.seq - 1)
        ids = data[start:start + a.seq].view(1, -1)
        tgt = data[start + 1:start + a.seq + 1].view(1, -1)
        opt.zero_grad(set_to_none=True)
        if a.dtype == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(ids, tgt)
        else:
            loss = model(ids, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    first = step(0)
    t = time.perf_counter()
    last = first
    for i in range(1, a.steps + 1):
        last = step(i)
    dt = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({
        "peer": f"pytorch {torch.__version__} eager", "family": a.family, "seq": a.seq, "dtype": a.dtype, "threads": a.threads,
        "tokens_per_s": a.steps * a.seq / dt, "peak_rss_mib": rss, "loss_first": first, "loss_last": last,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
