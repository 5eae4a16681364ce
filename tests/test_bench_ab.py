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


def test_ab_report_tabulates_each_variants_range_over_rounds(tmp_path: Path) -> None:
    """`zerodram bench ab-report`: a case per (B, L), a column per variant in run order, the range
    over rounds in us ("-" where a variant printed nothing for the case); a file that is not
    ab.sh's output is refused with its line."""
    from bench_cli import run_bench

    lines = [
        {"variant": "base", "round": 1, "B": 8, "L": 8192, "fp2_ms": 0.0305},
        {"variant": "new", "round": 1, "B": 8, "L": 8192, "fp2_ms": 0.0290},
        {"variant": "base", "round": 2, "B": 8, "L": 8192, "fp2_ms": 0.0307},
        {"variant": "new", "round": 2, "B": 8, "L": 8192, "fp2_ms": 0.0290},
        {"variant": "base", "round": 1, "B": 1, "L": 8192, "fp2_ms": 0.0160},
    ]
    f = tmp_path / "ab.jsonl"
    f.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = run_bench(["ab-report", str(f)])
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.strip() and not line.startswith("fp2_ms")]
    assert rows == [["case", "base", "new"], ["B=1", "L=8192", "16.0", "-"], ["B=8", "L=8192", "30.5-30.7", "29.0"]]
    f.write_text('{"B": 8}\n')
    out = run_bench(["ab-report", str(f)])
    assert out.returncode == 2 and "ab.jsonl:1: no 'variant' field" in out.stderr
