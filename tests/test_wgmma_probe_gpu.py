"""The warpgroup MMA probe (kernels/cuda/probe_wgmma.cu; test_jit.py compiles it for the sm_90a its
source declares): on a GPU each of its three forms (f16, e5m2 x e4m3, s8; A from registers, B through a shared-memory
descriptor) equals torch's product of the same operands, which fixes the fragment and descriptor
layouts the probe's comment states.

Shape legend: M = 64 rows of A and D, N = 8 rows of B (columns of D), K = 16 (f16) or 32 (8-bit).

Tolerances: s8 exact (int32 sums of 32 products); e5m2 x e4m3 products are exact in fp32 and the
operands are drawn so that every partial sum is too (small integers times powers of two), so exact;
f16: fp32 accumulation of 16 products, 1e-5 relative.
"""

from __future__ import annotations

import pytest
import torch

from zerodram.kernels.jit import SOURCE_DIR, BuildOptions, source_arch

PROBE = BuildOptions.make(arch=source_arch(SOURCE_DIR / "probe_wgmma.cu"))


def _run(fn: str, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    from zerodram.kernels.module import launch, load_module, ptr

    d = torch.full((64, 8), -7, dtype=out_dtype, device="cuda")  # poisoned: every element is written
    kernel = load_module("probe_wgmma", PROBE).kernel(fn)
    launch(kernel, grid=(1,), block=(128,), args=(ptr(a), ptr(b), ptr(d)))
    torch.cuda.synchronize()
    return d


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1])
def test_wgmma_forms_match_torch(seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def ints(shape, lo, hi):
        return torch.randint(lo, hi, shape, generator=g, device="cuda")

    # f16: A [64, 16], B [8, 16]
    a, b = torch.randn(64, 16, generator=g, device="cuda").half(), torch.randn(8, 16, generator=g, device="cuda").half()
    d = _run("probe_wgmma_f16", a, b, torch.float32)
    torch.testing.assert_close(d, a.float() @ b.float().T, rtol=1e-5, atol=1e-5)

    # e5m2 x e4m3: A [64, 32] levels (small integers times 2^-2..2^2), B [8, 32] weights (2^-3..2^3
    # times 1..15 / 8), so every product and sum is exact in fp32
    a8 = (ints((64, 32), -3, 4) * torch.exp2(ints((64, 32), -2, 3).float())).to(torch.float8_e5m2)
    b8 = (ints((8, 32), 1, 16) / 8 * torch.exp2(ints((8, 32), -3, 4).float())).to(torch.float8_e4m3fn)
    d = _run("probe_wgmma_e5m2_e4m3", a8.view(torch.uint8), b8.view(torch.uint8), torch.float32)
    torch.testing.assert_close(d, a8.float() @ b8.float().T, rtol=0, atol=0)

    # s8: A [64, 32], B [8, 32], full int8 range
    a, b = ints((64, 32), -128, 128).to(torch.int8), ints((8, 32), -128, 128).to(torch.int8)
    d = _run("probe_wgmma_s8", a, b, torch.int32)
    assert torch.equal(d, (a.int() @ b.int().T).int())
