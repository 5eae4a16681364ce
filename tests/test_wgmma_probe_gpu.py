"""The warpgroup MMA probe (kernels/cuda/probe_wgmma.cu; test_jit.py compiles it for the sm_90a its
source declares): on a GPU each of its three forms (f16, e5m2 x e4m3, s8; A from registers, B through a shared-memory
descriptor) equals torch's product of the same operands, which fixes the fragment and descriptor
layouts the probe's comment states.

Shape legend: M = 64 rows of A and D, N = 8 rows of B (columns of D), K = 16 (f16) or 32 (8-bit).

Tolerances: s8 exact (int32 sums of 32 products); f16: fp32 accumulation of 16 products, 1e-5
relative; e5m2 x e4m3: 2^-9 of the sum of the products' magnitudes. Those operands are drawn so that
every product and partial sum is exact in fp32 (small integers times powers of two), but Hopper's FP8
MMA does not accumulate in full fp32: on the H200 (2026-12-05) 18-19% of the sums came back off by up
to 2^-12 of their value. A wrong fragment or descriptor layout moves whole products (errors of order
the sum itself), so the bound still fixes the layout. The kernel that uses this form (the FP8
value-product kernel on branch next/fp8-warpgroup) accumulates each stage from zero in the tensor
core and adds in fp32 for this reason.
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
    # times 1..15 / 8), so every product and sum is exact in fp32 (the tensor core's sum is not: see
    # the module docstring)
    a8 = (ints((64, 32), -3, 4) * torch.exp2(ints((64, 32), -2, 3).float())).to(torch.float8_e5m2)
    b8 = (ints((8, 32), 1, 16) / 8 * torch.exp2(ints((8, 32), -3, 4).float())).to(torch.float8_e4m3fn)
    d = _run("probe_wgmma_e5m2_e4m3", a8.view(torch.uint8), b8.view(torch.uint8), torch.float32)
    bound = 2.0**-9 * (a8.float().abs() @ b8.float().abs().T)  # [64, 8]
    err = (d - a8.float() @ b8.float().T).abs()
    assert bool((err <= bound).all()), f"e5m2 x e4m3: error {err.max().item()} past 2^-9 of the magnitudes"

    # s8: A [64, 32], B [8, 32], full int8 range
    a, b = ints((64, 32), -128, 128).to(torch.int8), ints((8, 32), -128, 128).to(torch.int8)
    d = _run("probe_wgmma_s8", a, b, torch.int32)
    assert torch.equal(d.cpu(), a.cpu().int() @ b.cpu().int().T)  # torch has no int32 matmul on CUDA
