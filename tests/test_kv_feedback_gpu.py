"""Error-feedback rounding kernel (kernels/cuda/fp2_feedback.cu): compiles for sm_90 (CPU), refuses
what it cannot take (CPU), and on a GPU matches `feedback_codes_reference`, the torch loop run on the
same device, alone and inside an Fp2KVCache.

Shape legend: T tokens, H KV heads, D head dim, NB scale blocks per token, BS channels per block.

Agreement: the kernel does the loop's fp32 operations in the loop's order with the loop's roundings
(IEEE divisions, products rounded before the subtraction, as torch's CUDA addcmul with value=-1),
so codes are expected identical. The tests ask for >= 99.9% equal codes, not equality: a torch build
whose elementwise kernels round one of those steps differently (e.g. an addcmul that fuses the
product into an FMA) moves a running value by an ulp, which flips a code only where x / s sits
within an ulp of a midpoint; such a flip then feeds a different error into that (token, head)'s
later channels. The weighted error eᵀ W e is what the rounding optimises, and it must agree within
1e-3 relative whatever the codes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from zerodram.kernels.feedback import feedback_build_options, feedback_codes_cuda
from zerodram.kernels.jit import compile_cubin
from zerodram.runtime.errors import ConfigError
from zerodram.runtime.kv import quantize
from zerodram.runtime.kv.feedback import feedback_codes, feedback_codes_reference, feedback_factor
from zerodram.runtime.kv.levels import named_levels

BS = 16  # channels per scale block of the synthetic inputs


@pytest.mark.parametrize("head_dim", [64, 128, 80, 256])
def test_feedback_kernel_compiles_for_sm90(head_dim: int) -> None:
    assert compile_cubin("fp2_feedback", feedback_build_options(head_dim))[:4] == b"\x7fELF"


def _case(T: int, H: int, D: int, *, offsets: bool, exact: bool, seed: int, device: str = "cpu"):
    """Inputs of `feedback_codes` built on the CPU from one seed, then moved: y [T, H, D], per-element
    scales and offsets (block values repeated), exact mask, levels, and W [H, D, D] with its factor."""
    gen = torch.Generator().manual_seed(seed)
    lv = named_levels("lm")
    y = torch.randn(T, H, D, generator=gen) * (1 + torch.rand(H, D, generator=gen))  # [T, H, D]
    blocks = y.view(T, H, D // BS, BS)
    sb = blocks.abs().amax(-1) / float(lv.abs().max())  # [T, H, NB]
    ob = 0.1 * torch.randn(T, H, D // BS, generator=gen) if offsets else None
    mask = torch.rand(T, H, D, generator=gen) < 0.02 if exact else None
    # W: a few strong directions (the queries' mean and principal axes) over an isotropic floor
    a = torch.randn(H, D, 4, generator=gen)
    w = a @ a.transpose(1, 2) + 0.05 * torch.eye(D)  # [H, D, D] SPD
    factor = feedback_factor(w)  # [H, D, D] fp32 upper triangular

    def per_elem(b):
        return b[..., None].expand(T, H, D // BS, BS).reshape(T, H, D) if b is not None else None

    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return dict(
        y=move(y), scales=move(per_elem(sb)), offsets=move(per_elem(ob)), levels=move(lv),
        factor=move(factor), exact=move(mask),
    ), move(w)  # fmt: skip


def _weighted_error(codes: torch.Tensor, args: dict, w: torch.Tensor) -> float:
    """Σ over (token, head) of eᵀ W e, e = y - (L[code] s + o), 0 where kept exactly."""
    yh = args["levels"][codes.long()] * args["scales"]
    if args["offsets"] is not None:
        yh = yh + args["offsets"]
    e = args["y"] - yh  # [T, H, D]
    if args["exact"] is not None:
        e = torch.where(args["exact"], 0.0, e)
    return float(torch.einsum("thd,hde,the->", e.double(), w.double(), e.double()))


def test_feedback_codes_on_cpu_is_the_reference() -> None:
    args, _ = _case(5, 2, 64, offsets=True, exact=True, seed=3)
    assert torch.equal(feedback_codes(**args), feedback_codes_reference(**args))


def test_feedback_kernel_refuses_cpu_tensors() -> None:
    args, _ = _case(1, 1, 64, offsets=False, exact=False, seed=0)
    with pytest.raises(ConfigError, match="CUDA"):
        feedback_codes_cuda(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H", [1, 8])
@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize(("offsets", "exact"), [(False, False), (True, False), (False, True), (True, True)])
def test_gpu_feedback_kernel_matches_torch_loop(D: int, H: int, T: int, offsets: bool, exact: bool) -> None:
    args, w = _case(T, H, D, offsets=offsets, exact=exact, seed=1000 * D + 10 * H + T, device="cuda")
    got = feedback_codes_cuda(**args)
    want = feedback_codes_reference(**args)
    assert got.shape == want.shape == (T, H, D) and got.dtype == want.dtype == torch.uint8
    agree = float((got == want).float().mean())
    assert agree >= 0.999, f"{agree:.5f} of codes equal ({int((got != want).sum())} differ)"
    e_got, e_want = _weighted_error(got, args, w), _weighted_error(want, args, w)
    assert abs(e_got - e_want) <= 1e-3 * e_want, (e_got, e_want)
    assert torch.equal(feedback_codes(**args), got)  # the dispatcher takes the kernel on CUDA


@pytest.mark.gpu
def test_gpu_feedback_kernel_reads_strided_inputs() -> None:
    """y a non-contiguous view (the K half of a [T, H, 2, D] pair) and scales a stride-0 broadcast
    of one scale per (token, head): read in place, same codes as from contiguous copies."""
    args, _ = _case(9, 4, 128, offsets=True, exact=True, seed=7, device="cuda")
    y = args["y"]
    pair = torch.stack([y, -y], 2)  # [T, H, 2, D]
    s = (y.abs().amax(-1, keepdim=True) / float(args["levels"].abs().max())).expand_as(y)  # stride 0
    strided = dict(args, y=pair[:, :, 0], scales=s)
    assert not strided["y"].is_contiguous() and strided["scales"].stride(-1) == 0
    dense = dict(args, scales=s.contiguous())
    got = feedback_codes_cuda(**strided)
    assert torch.equal(got, feedback_codes_cuda(**dense))
    assert float((got == feedback_codes_reference(**dense)).float().mean()) >= 0.999


def _filled_cache(device: str, D: int, kernel: bool, monkeypatch: pytest.MonkeyPatch):
    """An Fp2KVCache of the default format (fb=1, tail=1, window=47) with random feedback factors,
    filled by one long chunk (a many-token flush) then token by token (one-token flushes)."""
    from zerodram.runtime.kv.format import DEFAULT_FP2, parse_kv_spec
    from zerodram.runtime.kv.fp2_cache import Fp2KVCache
    from zerodram.runtime.kv.params import layer_params

    H = 2
    spec = parse_kv_spec(DEFAULT_FP2).spec
    assert spec.k.feedback and spec.v.feedback
    gen = torch.Generator().manual_seed(D)
    params = []
    for p in layer_params(spec, 0, H, D):
        a = torch.randn(H, D, 4, generator=gen)
        params.append(replace(p, feedback=feedback_factor(a @ a.transpose(1, 2) + 0.05 * torch.eye(D))))
    with monkeypatch.context() as m:
        if not kernel:
            m.setattr(quantize, "feedback_codes", feedback_codes_reference)
        cache = Fp2KVCache(
            spec=spec, params=tuple(params), num_pages=8, page_size=spec.page_size, num_kv_heads=H,
            head_dim=D, max_seqs=2, device=device,
        )  # fmt: skip
        k = torch.randn(260, H, D, generator=gen).to(device)
        v = torch.randn(260, H, D, generator=gen).to(device)
        sid = cache.new_sequence()
        cache.append(sid, k[:250], v[:250])
        for i in range(250, 260):
            cache.append(sid, k[i : i + 1], v[i : i + 1])
    return cache, sid


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_fp2_cache_pages_with_kernel_equal_torch_loop(D: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from zerodram.runtime.kv.pack import unpack_codes

    fast, sid = _filled_cache("cuda", D, kernel=True, monkeypatch=monkeypatch)
    ref, _ = _filled_cache("cuda", D, kernel=False, monkeypatch=monkeypatch)
    assert fast._flushed(fast.seq_len(sid)) > 190  # the chunk's flush and ten one-token flushes
    for a, b in ((fast.k, ref.k), (fast.v, ref.v)):
        assert torch.equal(a.scales, b.scales)  # scales are chosen before (and without) feedback
        ca, cb = unpack_codes(a.codes), unpack_codes(b.codes)  # [pages, H, P, D]
        agree = float((ca == cb).float().mean())
        assert agree >= 0.999, f"{agree:.5f} of page codes equal"


def test_feedback_reference_leaves_its_inputs_alone() -> None:
    """T = H = 1 (a decode write): the permuted copy must be a copy, not the caller's y."""
    args, _ = _case(1, 1, 64, offsets=True, exact=False, seed=11)
    before = {k: v.clone() for k, v in args.items() if v is not None}
    feedback_codes_reference(**args)
    assert all(torch.equal(args[k], v) for k, v in before.items())
