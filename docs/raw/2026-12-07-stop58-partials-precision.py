"""What storing the split partials as normalised fp16 / bf16 would cost in accuracy (CPU, float64 truth).

Benchmark shape: Hkv 8, G 4, D 128, random FP2 pages (the benchmark's generator), B = 1, its 36 bf16
tokens as the last partial. Each split's partial is made in fp32 as the kernel makes it; the merge
then takes o / l rounded to the stored type. Run from the repository root:

    PYTHONSAFEPATH=1 .venv/bin/python docs/raw/2026-12-07-stop58-partials-precision.py
"""

import math

import torch

from zerodram.runtime.attention import random_decode_batch, random_fp2_layer
from zerodram.runtime.attention.reference import sequence_kv

HKV, G, D, P, HP = 8, 4, 128, 64, 36


def case(L: int, S: int, q_scale: float) -> str:
    gen = torch.Generator().manual_seed(L + S)
    pages = math.ceil(L / P)
    layer = random_fp2_layer(pages, HKV, P, D, generator=gen, v_layout="quad")
    batch = random_decode_batch([L], [HP], pages, HKV, P, D, hp_max=HP, generator=gen)
    sk = sequence_kv(layer, batch, 0, "e4m3")
    q = torch.randn(HKV, G, D, generator=gen, dtype=torch.float64) * q_scale
    k, v = sk.k.double(), sk.v.double()  # [Hkv, L + HP, D]
    logits = (q @ k.transpose(1, 2)) * D**-0.5  # [Hkv, G, N]
    truth = torch.softmax(logits, -1) @ v
    tok = 32 * math.ceil(L / S / 32)
    bounds = [(i, min(i + tok, L)) for i in range(0, L, tok)] + [(L, logits.shape[-1])]  # splits, bf16 tokens
    parts = []
    for lo, hi in bounds:
        lg = logits[..., lo:hi].float()
        m = lg.amax(-1, keepdim=True)
        w = torch.exp(lg - m)
        parts.append((m, w.sum(-1, keepdim=True), w @ v[:, lo:hi].float()))  # fp32 (m, l, o), as the kernel

    def rel_error(stored: torch.dtype) -> float:
        top = torch.stack([p[0] for p in parts]).amax(0)
        num = den = 0
        for m, l, o in parts:
            wt = torch.exp(m - top)
            num = num + wt * (o / l).to(stored).float() * l  # the partial as stored, weighted back
            den = den + wt * l
        return float(((num / den).double() - truth).norm() / truth.norm())

    most = max(float((o / l).abs().max()) for _, l, o in parts)
    errs = ", ".join(f"{t}: {rel_error(getattr(torch, t)):.2e}" for t in ("float32", "float16", "bfloat16"))
    return f"L={L} S={len(bounds) - 1} q x{q_scale}: partials {errs}; |o / l| at most {most:.2f}"


if __name__ == "__main__":
    for args in [(32768, 16, 1.0), (131072, 33, 1.0), (131072, 33, 4.0)]:
        print(case(*args), flush=True)
