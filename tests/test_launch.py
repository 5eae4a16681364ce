"""`zerodram launch` derives torchrun's arguments from a topology and really runs the ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from multirank import free_port, run_ranks

from zerodram.launch.cli import main
from zerodram.launch.launcher import plan_launch
from zerodram.runtime import smoke
from zerodram.runtime.context import RankContext, TorchrunEnv, check_world
from zerodram.runtime.envs import ENVS
from zerodram.runtime.errors import ConfigError, RankTimeoutError, WorldMismatchError
from zerodram.runtime.topology import load_topology, resolve_topology_path

ROOT = Path(__file__).resolve().parents[1]


def test_plan_for_two_nodes() -> None:
    plan = plan_launch("hgx-h100-2x8", node_rank=1, master_port=None, job=["smoke"])
    argv = plan.torchrun_argv()
    assert "--nnodes=2" in argv
    assert "--nproc-per-node=8" in argv
    assert "--node-rank=1" in argv
    assert argv[-3:] == ["-m", "zerodram.launch.worker", "smoke"]
    assert "--node-rank 0" in plan.command_for_node(0)


def test_torchruns_environment_names_the_topology_and_keeps_the_users_threads() -> None:
    plan = plan_launch("local-cpu-4", node_rank=0, master_port=None, job=["smoke"])
    env = plan.environment({"PATH": "/bin"})
    assert env["ZERODRAM_TOPOLOGY"].endswith("local-cpu-4.yaml") and env["PYTHONSAFEPATH"] == "1"
    assert env["OMP_NUM_THREADS"] == "1" and env["PATH"] == "/bin"
    assert plan.environment({"OMP_NUM_THREADS": "8"})["OMP_NUM_THREADS"] == "8"
    assert "OMP_NUM_THREADS" not in plan_launch("h200-1", 0, None, ["smoke"]).environment({})  # one rank a node


def test_dry_run_prints_every_node(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--topology", "hgx-h100-2x8", "--dry-run", "--", "smoke"]) == 0
    err = capsys.readouterr().err
    assert "node 0:" in err
    assert "node 1: zerodram launch" in err
    assert "--nproc-per-node=8" in err


def test_node_rank_outside_topology_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--topology", "local-cpu-4", "--node-rank", "3", "--dry-run", "--", "smoke"]) == 2
    assert "outside the topology's 1 node" in capsys.readouterr().err


def test_missing_job_is_an_error() -> None:
    with pytest.raises(ConfigError, match="no job given"):
        plan_launch("local-cpu-4", 0, None, [])


@pytest.mark.parametrize("port", [0, 70000])
def test_master_port_outside_tcp_ports_is_an_error(port: int) -> None:
    with pytest.raises(ConfigError, match=rf"--master-port {port} is not a TCP port \(expected 1\.\.65535\)"):
        plan_launch("local-cpu-4", 0, port, ["smoke"])


def test_bench_without_a_subcommand_lists_the_benchmarks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench"]) == 2
    out = capsys.readouterr().out
    assert out.startswith("usage: zerodram bench")
    assert "dispatch" in out and "decode" in out


def test_demo_answers_help_and_bad_options_once_before_torchrun(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", "--", "--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out.count("usage: demo") == 1
    with pytest.raises(SystemExit) as info:
        main(["demo", "--dry-run", "--", "--max-tokens", "-3"])
    assert info.value.code == 2
    assert "argument --max-tokens: expected an integer >= 1, got '-3'" in capsys.readouterr().err
    assert main(["demo", "--dry-run", "--", "--svg", "/dev/null/x.svg"]) == 2
    err = capsys.readouterr().err
    assert "--svg /dev/null/x.svg: /dev/null is not a directory" in err
    assert "zerodram.launch.torchrun" not in err, "refused before the launch"


@pytest.mark.parametrize("job", ["demo", "serve"])
def test_launch_answers_a_jobs_help_once_before_torchrun(capsys: pytest.CaptureFixture[str], job: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(["launch", "--topology", "local-cpu-4", "--", job, "--help"])
    assert info.value.code == 0
    out, err = capsys.readouterr()
    assert out.count(f"usage: {job}") == 1
    assert "zerodram.launch.torchrun" not in err, "answered before the launch"


def test_launch_refuses_an_unknown_job_before_torchrun(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--topology", "local-cpu-4", "--", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "unknown job 'nosuch'; jobs: demo, serve, smoke" in err
    assert "zerodram.launch.torchrun" not in err


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--threads", "-1"),
        ("--needle-trials", "-1"),
        ("--needle-ctx", "-5"),
        ("--ctx", "1"),
        ("--windows", "0"),
    ],
)
def test_eval_kv_refuses_bad_numbers_when_parsing(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["eval-kv", "--kv", "fp2", flag, value])
    assert info.value.code == 2
    assert f"argument {flag}: expected an integer >= " in capsys.readouterr().err


def test_a_closed_pipe_ends_quietly() -> None:
    cli = f"{sys.executable} -m zerodram.launch.cli topo check local-cpu-4 local-cpu-4"
    proc = subprocess.run(["bash", "-c", f"{cli} | head -c 0"], capture_output=True, text=True, timeout=60)
    assert proc.stderr == ""


def _env(rank: int, world: int, local_world: int | None = None, node: int = 0) -> TorchrunEnv:
    return TorchrunEnv(
        rank=rank,
        local_rank=rank % (local_world or world),
        world_size=world,
        local_world_size=local_world or world,
        node_rank=node,
        master_addr="127.0.0.1",
        master_port=1,
    )


def test_world_size_mismatch_names_both_numbers() -> None:
    topo = load_topology(resolve_topology_path("local-cpu-4"))
    with pytest.raises(WorldMismatchError, match=r"local-cpu-4.yaml has 4 ranks, torchrun started 2"):
        check_world(topo, _env(0, 2))


def test_ranks_per_node_mismatch_names_both_numbers() -> None:
    topo = load_topology(resolve_topology_path("hgx-h100-2x8"))
    with pytest.raises(WorldMismatchError, match=r"8 ranks per node, torchrun started 4"):
        check_world(topo, _env(0, 16, local_world=4))


def test_rank_placed_elsewhere_names_both_places() -> None:
    topo = load_topology(resolve_topology_path("hgx-h100-2x8"))
    with pytest.raises(
        WorldMismatchError, match=r"puts rank 9 on node 1 as local rank 1, torchrun started it on node 0"
    ):
        check_world(topo, _env(9, 16, local_world=8, node=0))


def test_not_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match="not started by torchrun"):
        TorchrunEnv.from_environ()


@pytest.mark.parametrize("var", ["ZERODRAM_WAIT_TIMEOUT_S", "ZERODRAM_EP_DEVICE_TIMEOUT_S"])
@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "1e12"])
def test_nonsense_timeouts_are_refused_by_name(monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    monkeypatch.setenv(var, value)
    env_var = getattr(ENVS, var.removeprefix("ZERODRAM_"))
    with pytest.raises(ConfigError, match=rf"{var}='{value}' must be in \[0.001, 1e\+09\]"):
        env_var.get()
    monkeypatch.setenv(var, "0.5")
    assert env_var.get() == 0.5


@pytest.mark.parametrize(
    ("var", "value", "want"),
    [("LOCAL_RANK", "-3", ">= 0"), ("LOCAL_WORLD_SIZE", "0", ">= 1"), ("GROUP_RANK", "-7", ">= 0")],
)
def test_nonsense_torchrun_variables_are_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, want: str
) -> None:
    for name, ok in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, ok)
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=f"{var}='{value}' must be {want}"):
        TorchrunEnv.from_environ()


def test_a_rank_that_never_joins_fails_the_rendezvous_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of 2 alone: the store waits for a client that never comes, and says so as a
    `RankTimeoutError` naming the rank, the world, the address and the limit."""
    port = free_port()
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**env, "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(
        RankTimeoutError,
        match=rf"rank 0/2: rendezvous at tcp://127.0.0.1:{port} failed after .*s \(limit 0.5s\)",
    ):
        RankContext.create(device="cpu", timeout_s=0.5)


@pytest.mark.parametrize("stderr", ["io.StringIO()", "open(os.devnull, 'w'); sys.stderr.close()"])
def test_stage_watchdog_exits_even_when_stderr_fails(stderr: str) -> None:
    """Printing the report raises (stderr captured or closed): the stuck process must still end."""
    code = (
        f"import io, os, sys, time; sys.stderr = {stderr}\n"
        "from zerodram.launch.watchdog import StageWatchdog\n"
        "d = StageWatchdog('rank 1/2', poll_s=0.05); d.stage('barrier', 0.2); time.sleep(30)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 4, out.stderr


def _smoke(ctx) -> int:
    return smoke.run(ctx, [])


@pytest.mark.slow
def test_smoke_job_on_the_harness() -> None:
    topo = load_topology(resolve_topology_path("local-cpu-4"))
    assert run_ranks(_smoke, 4, topology=topo) == [0, 0, 0, 0]


@pytest.mark.slow
def test_the_readme_demo_end_to_end(tmp_path: Path) -> None:
    """The README's path, shortened: `zerodram demo` execs torchrun, which starts 4 CPU ranks that
    serve the packaged SmolLM2 as experts with the FP2 KV cache; rank 0 prints plain lines (no
    terminal here), the answers, and appends metrics JSON lines."""
    from zerodram.runtime.loading.checkpoint import find_packaged_gguf

    try:
        find_packaged_gguf()
    except ConfigError as err:
        pytest.skip(str(err))
    env = dict(os.environ, PYTHONUNBUFFERED="1", ZERODRAM_WAIT_TIMEOUT_S="120")
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "zerodram.launch.cli", "demo", "--", "--max-tokens", "8"]
    cmd += ["--prompt", "What is the capital of France?", "--prompt", "Name a fruit."]
    cmd += ["--metrics-file", str(metrics)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "SmolLM2-135M-Instruct as 4 experts over 4 rank(s), KV fp2" in out
    assert "zerodram local-cpu-4 t=" in out, "plain status lines"
    assert "Paris" in out
    assert "[rank 1, 8 tokens" in out, "the second request served on rank 1"
    last = json.loads(metrics.read_text().splitlines()[-1])
    assert [r["status"] for r in last["ranks"]] == ["ok"] * 4


@pytest.mark.slow
def test_real_torchrun_world_mismatch_fails_fast() -> None:
    """torchrun (as `zerodram launch` runs it) started with the wrong number of ranks: every rank exits
    2 naming both numbers, and the launch exits 2 with one line, not torchrun's traceback."""
    env = dict(os.environ, ZERODRAM_TOPOLOGY="local-cpu-4")
    cmd = [
        sys.executable,
        "-m",
        "zerodram.launch.torchrun",
        "--nnodes=1",
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
        "-m",
        "zerodram.launch.worker",
        "smoke",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr
    assert "has 4 ranks, torchrun started 2" in proc.stdout + proc.stderr
    for rank in (0, 1):  # each rank's error names the rank
        assert f"zerodram worker (rank {rank} of 2): error:" in proc.stderr
    assert proc.stderr.count("zerodram launch: rank ") == 1
    assert "exited with code 2 first; 1 other rank(s) stopped too" in proc.stderr
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr


def test_a_rank_killed_by_a_signal_is_named_with_a_shell_exit_code() -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from zerodram.launch.torchrun import first_failure_line

    failures = {3: ProcessFailure(local_rank=1, pid=1, exitcode=-9, error_file="<N/A>")}
    line, code = first_failure_line(ChildFailedError("zerodram.launch.worker", failures))
    assert line == "zerodram launch: rank 3 (local rank 1) was killed by SIGKILL first"
    assert code == 137
