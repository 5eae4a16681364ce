"""Decode-sized SwiGLU expert kernels (kernels/cuda/moe_experts.cu): compile for sm_90 (CPU), the
path choice and its refusals (CPU), and on a GPU agreement with the per-expert loop reference.

Shape legend: N packed rows, D hidden, F expert FFN dim, El local experts.

Agreement: the kernel accumulates in fp32 over the whole reduction and rounds the SwiGLU product
once to bf16. Against that arithmetic done in fp32 torch (`_reference_fp32`) outputs must agree within
0.8% relative plus 0.4% of the largest output (bf16 rounding of the result, and the odd intermediate
that rounds to the neighbouring bf16 because the summation order differs); against the bf16 loop path
(`grouped_swiglu(path="loop")`, cuBLAS per expert, which also rounds gate and up to bf16) within 3e-2
absolute plus 3% relative. Outputs are O(1) (weights scaled by 1/sqrt(fan-in)): a layout or indexing bug
misses by O(1).
"""

from __future__ import annotations

import pytest
import torch

from zerodram.kernels.experts import DEFAULT_CONFIG, ExpertsConfig, experts_build_options, swiglu_experts_cuda
from zerodram.kernels.jit import compile_cubin
from zerodram.runtime.errors import ConfigError
from zerodram.runtime.moe.experts import ExpertShard, choose_experts_path, grouped_swiglu

# the default kernels (bulk for experts with up to 16 rows, registers for more), splitting at the
# small dims of these cases too, and each kind alone, every one on every case below
CONFIGS = [
    str(DEFAULT_CONFIG).replace("@4096", "@64"),  # the split at the test's small dims
    "bulk:1x4x512x2x16/1x4x512x2x16",
    "4x1x8/4x2x8",
]


def test_experts_kernel_compiles_for_sm90() -> None:
    cfg = DEFAULT_CONFIG
    assert cfg.bulk is not None and cfg.regs is not None
    for shape in cfg.regs:
        assert compile_cubin("moe_experts", experts_build_options(shape))[:4] == b"\x7fELF"
    for shape in cfg.bulk:
        assert compile_cubin("moe_experts_bulk", experts_build_options(shape))[:4] == b"\x7fELF"


def _shard(El: int, D: int, F: int, seed: int, device: str = "cpu") -> ExpertShard:
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, fan_in: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) / fan_in**0.5).to(torch.bfloat16).to(device)

    return ExpertShard(
        tuple(range(El)), rnd(El, F, D, fan_in=D), rnd(El, F, D, fan_in=D), rnd(El, D, F, fan_in=F)
    )


def test_kernel_shapes_are_checked() -> None:
    from zerodram.kernels.experts import BulkShape, KernelShape, supports_shapes

    assert str(ExpertsConfig.parse("8x1x4/4x2x4")) == "8x1x4/4x2x4"
    for text in CONFIGS:
        assert str(ExpertsConfig.parse(text)) == text
    assert ExpertsConfig.parse(CONFIGS[1]).split(64) == (2**31 - 1, None)
    assert ExpertsConfig.parse(CONFIGS[2]).split(8192) == (None, 0)
    assert DEFAULT_CONFIG.split(8192) == (16, 16) and DEFAULT_CONFIG.split(2048) == (None, 0)
    assert ExpertsConfig.parse(str(DEFAULT_CONFIG).replace("@4096", "@64")).split(576) == (16, 16)
    with pytest.raises(ConfigError, match="multiple of 64"):
        BulkShape(1, 4, 96, 4)
    with pytest.raises(ConfigError, match="shared memory"):
        BulkShape(2, 4, 512, 4)  # 4 stages x 96 rows x 1088 B
    with pytest.raises(ConfigError, match="8 stages"):
        BulkShape(1, 4, 64, 9, 8)  # the barriers would overrun the ring's 128-byte header
    with pytest.raises(ConfigError, match="two shapes"):
        ExpertsConfig.parse("bulk:1x4x512x2x16")
    with pytest.raises(ConfigError, match="same tokens"):
        ExpertsConfig((BulkShape(1, 4, 256, 4, 16), BulkShape(1, 4, 256, 4, 8)), None)
    with pytest.raises(ConfigError, match="1024"):
        KernelShape(16, 2, 4)  # 2 * 32 * 32 threads
    with pytest.raises(ConfigError, match="shared memory"):
        KernelShape(4, 4, 4)  # 7 * 4 * 2 KB
    assert not supports_shapes(0, 64) and not supports_shapes(64, 48) and supports_shapes(576, 1536)


def test_path_choice_on_cpu() -> None:
    shard = _shard(4, 64, 128, seed=1)
    x = torch.randn(8, 64).to(torch.bfloat16)
    assert choose_experts_path(x, shard, sent_rows=8) in ("grouped", "loop")  # the kernel is CUDA only
    with pytest.raises(ConfigError, match="CUDA"):
        grouped_swiglu(x, torch.tensor([2, 4, 6, 8], dtype=torch.int32), shard, "kernel")
    with pytest.raises(ConfigError, match="not one of"):
        grouped_swiglu(x, torch.tensor([2, 4, 6, 8], dtype=torch.int32), shard, "fast")  # type: ignore[arg-type]


def _reference_fp32(x: torch.Tensor, ends: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    """The kernel's arithmetic in plain torch: fp32 products of the bf16 inputs, the SwiGLU product
    rounded once to bf16, fp32 down projection. [N, D] fp32 for the rows up to ends[-1]."""
    out, start = [], 0
    for e, end in enumerate(ends.tolist()):
        xe = x[start:end].float()
        g, u = xe @ shard.w_gate[e].float().T, xe @ shard.w_up[e].float().T
        h = (torch.nn.functional.silu(g) * u).to(torch.bfloat16).float()
        out.append(h @ shard.w_down[e].float().T)
        start = end
    return torch.cat(out)


def _check(y: torch.Tensor, x: torch.Tensor, ends: torch.Tensor, shard: ExpertShard) -> None:
    """Within bf16 rounding of the fp32 reference (plus a flipped ulp of h here and there), and
    within a few ulps of the bf16 loop path."""
    N = int(ends[-1])
    y = y[:N].float()
    assert torch.isfinite(y).all(), "unwritten or non-finite rows"
    ref = _reference_fp32(x, ends, shard)
    err = (y - ref).abs()
    tol = 8e-3 * ref.abs() + 4e-3 * ref.abs().max()
    assert (err <= tol).all(), (
        f"max error {err.max():.4g} vs fp32 (ref there {ref.flatten()[err.argmax()]:.4g})"
    )
    loop = grouped_swiglu(x, ends, shard, "loop")[:N].float()
    assert ((y - loop).abs() <= 3e-2 + 3e-2 * loop.abs()).all()


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("D", "F", "counts"),
    [
        (256, 512, [0, 1, 7, 8, 9, 0, 31, 32, 33, 70, 0]),  # empty experts, group and pass edges
        (576, 1536, [3, 0, 17]),  # SmolLM2's dims: K % 256 != 0 takes the remainder loop (unroll 8)
        (1024, 2048, [1]),
        (608, 544, [5, 0, 9]),  # R % (16 * row tiles) != 0 (spare row tiles), K / 32 odd (uneven K split)
        (672, 800, [4, 11, 40, 16, 17]),  # bulk: partial last chunks (K % 512); 16 | 17 rows: the split
        (8192, 16384, [2, 5]),  # seed-700b's expert shape, 1.6 GB of weights
    ],
)
@pytest.mark.parametrize("config", CONFIGS)
def test_gpu_experts_kernel_matches_loop(D: int, F: int, counts: list[int], config: str) -> None:
    torch.manual_seed(sum(counts) + D)
    El = len(counts)
    shard = _shard(El, D, F, seed=D + El, device="cuda")
    N = sum(counts)
    x = torch.randn(N + 5, D, device="cuda").to(torch.bfloat16)  # [N + 5, D]: 5 rows past the end
    ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    torch.full((N + 5, max(D, F)), float("nan"), device="cuda")  # freed: the outputs likely reuse it
    y = swiglu_experts_cuda(x, ends, shard.w_gate, shard.w_up, shard.w_down, ExpertsConfig.parse(config))
    _check(y, x, ends, shard)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("D", "F"),
    [
        (512, 1024),  # both projections on the register kernels (K < 4096)
        (4096, 1024),  # gate+up split between the bulk and register kernels, down on the register ones
    ],
)
def test_gpu_experts_kernel_chosen_for_decode_and_graph_safe(D: int, F: int) -> None:
    """The auto choice takes the kernel at decode size, and a captured graph replays it correctly
    after the routing (the counts, on both sides of the bulk kernels' 16 rows) changed on the device."""
    El = 8
    shard = _shard(El, D, F, seed=7, device="cuda")
    x = torch.randn(64, D, device="cuda").to(torch.bfloat16)
    ends = torch.zeros(El, dtype=torch.int32, device="cuda")
    assert choose_experts_path(x, shard, sent_rows=16) == "kernel"
    assert choose_experts_path(x, shard, sent_rows=16 * El + 1) != "kernel"
    grouped_swiglu(x, ends, shard, "kernel")  # compile before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = grouped_swiglu(x, ends, shard, sent_rows=16)
    for counts in ([2, 0, 0, 3, 1, 0, 9, 1], [0, 0, 40, 0, 0, 0, 0, 24]):
        ends.copy_(torch.tensor(counts).cumsum(0))
        x.copy_(torch.randn_like(x, dtype=torch.float32))
        graph.replay()
        _check(y, x, ends, shard)
