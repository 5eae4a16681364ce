"""Shared pytest setup: `gpu` tests skip cleanly where there is no CUDA device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Hazard: `python -m pytest` puts the working directory on sys.path, and from the repo root that
# exposes our `kernels/` folder as a top-level `kernels` package. It then shadows the PyPI package
# of that name, which transformers (>= 5.25) imports. zerodram itself comes from the editable
# install (`zerodram.kernels`), so the repo root is never needed on the path: drop it. Spawned
# ranks inherit this sys.path.
_REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _REPO_ROOT]


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module's tests: on a crowded 2-core machine OpenMP spin-waits make
    tiny ops 1000x slower. Restores the count after."""
    import torch

    num = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num)
