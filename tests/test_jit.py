"""The kernel JIT: every shipped kernel compiles for sm_90 without a GPU; the cache behaves."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from zerodram.kernels import jit
from zerodram.kernels.jit import BuildOptions, KernelBuildError, compile_cubin, list_sources, source_arch


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZERODRAM_CACHE_DIR", str(tmp_path))
    jit._MEMO.cubins.clear()


def _is_elf(blob: bytes) -> bool:
    return blob[:4] == b"\x7fELF"


@pytest.mark.parametrize("source", list_sources(), ids=lambda p: p.stem)
def test_every_kernel_compiles_for_sm90(source: Path) -> None:
    """Each for sm_90, or the arch its source declares (`source_arch`: wgmma needs sm_90a)."""
    assert _is_elf(compile_cubin(source.stem, BuildOptions(arch=source_arch(source))))


def test_cache_is_keyed_by_options(tmp_path: Path) -> None:
    a = compile_cubin("smoke")
    b = compile_cubin("smoke", BuildOptions.make(defines={"ZD_SMOKE_MULT": "3u"}))
    assert a != b
    assert len(list((tmp_path / "kernels").glob("smoke-*.cubin"))) == 2
    jit._MEMO.cubins.clear()
    assert compile_cubin("smoke") == a  # from disk this time


def test_keep_source_switch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZERODRAM_KEEP_KERNEL_SOURCE", "1")
    compile_cubin("smoke")
    kept = list((tmp_path / "kernels").glob("smoke-*.cu"))
    assert kept
    assert "fill_pattern" in kept[0].read_text()


def test_ptxas_options_reach_ptxas() -> None:
    """-Xptxas=OPT is handed to ptxas: an option it does not know fails the build naming it."""
    assert _is_elf(compile_cubin("smoke", BuildOptions(extra=("-Xptxas=--register-usage-level=8",))))
    with pytest.raises(KernelBuildError, match="no-such-option"):
        compile_cubin("smoke", BuildOptions(extra=("-Xptxas=--no-such-option",)))
    with pytest.raises(KernelBuildError, match="unsupported compile flag"):
        compile_cubin("smoke", BuildOptions(extra=("-O9",)))


def test_missing_kernel_names_the_alternatives() -> None:
    with pytest.raises(KernelBuildError, match=r"no kernel source.*smoke"):
        compile_cubin("does_not_exist")


def test_compile_error_carries_nvrtc_log() -> None:
    with pytest.raises(KernelBuildError, match=r"NVRTC failed on smoke.cu"):
        compile_cubin("smoke", BuildOptions.make(defines={"ZD_SMOKE_MULT": "not_a_number"}))


def _compile_in_child(cache_dir: str, q: mp.Queue) -> None:
    import os

    os.environ["ZERODRAM_CACHE_DIR"] = cache_dir
    from zerodram.kernels.jit import BuildOptions, compile_cubin

    q.put(compile_cubin("smoke", BuildOptions.make(defines={"ZD_SMOKE_MULT": "7u"})))


@pytest.mark.slow
def test_ranks_of_a_node_compile_once(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_compile_in_child, args=(str(tmp_path), q)) for _ in range(3)]
    for p in procs:
        p.start()
    blobs = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert len(set(blobs)) == 1
    assert len(list((tmp_path / "kernels").glob("smoke-*.cubin"))) == 1
    assert not list((tmp_path / "kernels").glob(".smoke-*"))  # no temp file left behind


@pytest.mark.gpu
def test_smoke_kernel_runs_on_gpu() -> None:
    import numpy as np
    import torch

    from zerodram.kernels.module import launch, load_module, ptr

    n, seed = 100_003, 0xDEADBEEF
    out = torch.full((n,), 0xFFFFFFFF, dtype=torch.int64, device="cuda").to(torch.uint32)
    mod = load_module("smoke")
    launch(
        mod.kernel("fill_pattern"), grid=(64,), block=(256,), args=(ptr(out), np.int32(n), np.uint32(seed))
    )
    torch.cuda.synchronize()
    i = torch.arange(n, dtype=torch.int64)
    expected = ((i * 2654435761) & 0xFFFFFFFF) ^ seed
    assert torch.equal(out.cpu().to(torch.int64) & 0xFFFFFFFF, expected)
