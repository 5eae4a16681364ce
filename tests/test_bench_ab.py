"""benchmarks/ab.sh, the same-run A/B of source variants: each variant's files in the tree while
its command runs, JSON lines tagged with the variant and round, the tree put back afterwards."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

AB = Path(__file__).resolve().parents[1] / "benchmarks" / "ab.sh"


def _tree(tmp: Path) -> None:
    (tmp / "src").mkdir()
    (tmp / "src" / "k.cu").write_text("base\n")
    (tmp / "ab" / "base").mkdir(parents=True)
    (tmp / "ab" / "fast" / "src").mkdir(parents=True)
    (tmp / "ab" / "fast" / "src" / "k.cu").write_text("fast\n")


def test_variants_run_in_turn_and_the_tree_comes_back(tmp_path: Path) -> None:
    _tree(tmp_path)
    cmd = 'echo "{\\"k\\": \\"$(cat src/k.cu)\\"}"; echo a progress line'
    out = subprocess.run(
        ["bash", str(AB), "out", cmd, "ab/base", "ab/fast"], cwd=tmp_path, capture_output=True, text=True,
        timeout=60, env={"ROUNDS": "2", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in (tmp_path / "out" / "ab.jsonl").read_text().splitlines()]
    assert [(r["variant"], r["round"], r["k"]) for r in rows] == [
        ("base", 1, "base"), ("fast", 1, "fast"), ("base", 2, "base"), ("fast", 2, "fast"),
    ]  # fmt: skip
    assert "a progress line" in out.stdout
    assert (tmp_path / "src" / "k.cu").read_text() == "base\n"


def test_a_variant_file_without_a_counterpart_is_refused(tmp_path: Path) -> None:
    _tree(tmp_path)
    (tmp_path / "ab" / "fast" / "src" / "new.cu").write_text("x\n")
    out = subprocess.run(
        ["bash", str(AB), "out", "true", "ab/fast"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "src/new.cu has no counterpart" in out.stderr
    assert (tmp_path / "src" / "k.cu").read_text() == "base\n"
