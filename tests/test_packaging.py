"""The package layout: every sub-package is declared, kernel sources ship, every command has help."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from zerodram.launch.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {
    "runtime": "zerodram.runtime",
    "launch": "zerodram.launch",
    "kernels": "zerodram.kernels",
    "topologies": "zerodram.topologies",
}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_subpackage_is_listed() -> None:
    declared = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = set()
    for folder, prefix in MAPPED.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([prefix, *rel.parts]))
    assert found - declared == set(), "sub-packages missing from pyproject.toml [tool.setuptools]"
    assert declared - found == set(), "pyproject.toml lists packages that do not exist"


def test_kernel_sources_ship_as_package_data() -> None:
    data = _pyproject()["tool"]["setuptools"]["package-data"]["zerodram.kernels"]
    assert "cuda/*.cu" in data
    assert "cuda/*.cuh" in data
    assert list((ROOT / "kernels" / "cuda").glob("*.cu")), "no kernel sources"


def _subcommands() -> list[list[str]]:
    parser = build_parser()
    out = []
    for action in parser._subparsers._group_actions:  # argparse keeps no public accessor
        for name, sub in action.choices.items():
            out.append([name])
            for inner in getattr(sub, "_subparsers", None)._group_actions if sub._subparsers else []:
                out.extend([name, n] for n in inner.choices)
    return out


@pytest.mark.parametrize("argv", _subcommands(), ids=" ".join)
def test_every_command_has_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--version"])
    assert "zerodram" in capsys.readouterr().out


def test_our_folders_never_shadow_top_level_packages() -> None:
    """`kernels/` is `zerodram.kernels`; a bare `import kernels` must never find our folder (the
    PyPI `kernels` package, which transformers imports, would be shadowed). conftest drops the repo
    root that `python -m pytest` adds; `zerodram launch` sets PYTHONSAFEPATH for its workers."""
    import importlib.util

    for folder in MAPPED:
        spec = importlib.util.find_spec(folder)
        origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
        assert origin is None or ROOT / folder not in origin.parents, (folder, origin)


def test_commands_work_without_the_benchmarks_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An installed copy has no benchmarks/: the parser still builds (every other command works)
    and `bench X` fails alone, saying where the benchmark is expected."""
    from zerodram.launch import bench_cmd
    from zerodram.runtime.errors import ConfigError

    monkeypatch.setattr(bench_cmd, "REPO_ROOT", tmp_path)
    build_parser()
    assert main(["bench", "decode"]) == ConfigError.exit_code
    assert "run from a source checkout" in capsys.readouterr().err


def test_generate_picks_its_device(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """generate runs on a GPU when one is visible (auto), on the host with --device cpu, and says so
    when --device cuda finds no GPU."""
    import torch

    from zerodram.runtime.context import one_process_context

    assert one_process_context("cpu") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert one_process_context("auto") is None
    assert main(["generate", "--prompt", "hi", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
