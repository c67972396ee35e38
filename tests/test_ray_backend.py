"""The Ray backend (flashbench/run/ray_backend.py) on a local Ray instance: the same statuses as a
local run, one trace line per pair, and a one-line error where Ray is not installed."""

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashbench import FlashbenchError, Repo
from flashbench.cli import main
from flashbench.run import RunOptions, Runner, select_solutions, select_workloads

ROOT = Path(__file__).resolve().parents[1]
DEFINITION = "mla_paged_decode_h16_ckv512_kpe64_ps1"
FIXTURES = Path(__file__).parent / "fixtures" / "solutions" / DEFINITION
SOLUTIONS = [ROOT / "solutions" / DEFINITION / "torch_vectorized", FIXTURES / "correct_dps",
             FIXTURES / "wrong_values", FIXTURES / "missing_dep"]


def run_with(repo_root, cache, trace_dir, backend):
    repo = Repo(repo_root)
    options = RunOptions(device="cpu", backend=backend, iters=2, warmup=0, timeout=60, trace_dir=trace_dir,
                         cache_dir=cache)
    runner = Runner(repo, DEFINITION, options)
    candidates = runner.candidates(select_solutions(repo, DEFINITION, [str(p) for p in SOLUTIONS]))
    return runner.run(candidates, select_workloads(repo, DEFINITION, [], "cpu"))


@pytest.fixture(scope="module")
def ray_run(repo_copy, shared_cache, tmp_path_factory):
    ray = pytest.importorskip("ray")
    result = run_with(repo_copy, shared_cache, tmp_path_factory.mktemp("ray"), "ray")  # starts and stops its own Ray
    assert not ray.is_initialized()
    return result


def test_the_same_statuses_as_a_local_run(ray_run, repo_copy, shared_cache, tmp_path):
    local = run_with(repo_copy, shared_cache, tmp_path, "local")
    recorded = {(t.solution, t.workload_name, t.status) for t in ray_run.traces}
    assert recorded == {(t.solution, t.workload_name, t.status) for t in local.traces}
    statuses = {(solution, status) for solution, _, status in recorded}
    assert statuses == {("reference", "PASSED"), ("torch_vectorized", "PASSED"), ("correct_dps", "PASSED"),
                        ("wrong_values", "INCORRECT_NUMERICAL"), ("missing_dep", "MISSING_DEPENDENCY")}


def test_one_trace_line_per_pair_with_speedups(ray_run):
    records = [json.loads(line) for line in ray_run.trace_file.read_text().splitlines()]
    pairs = [(r["solution"], r["workload_name"]) for r in records]
    assert len(pairs) == len(set(pairs)) == 10
    assert [r["solution"] for r in records[:2]] == ["reference", "reference"]
    for record in records:
        if record["status"] == "PASSED":
            assert record["performance"]["speedup"] > 0 and record["environment"]["device"] == "cpu"


def test_without_ray_the_error_is_one_line(module_repo, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    result = CliRunner().invoke(main, ["--root", str(module_repo), "run", "--def", "mla_paged_decode",
                                       "--backend", "ray", "--device", "cpu", "--trace-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "--backend ray needs Ray: pip install 'flashbench[ray]'" in result.output
    assert "Traceback" not in result.output
    with pytest.raises(FlashbenchError, match="needs Ray"):
        run_with(module_repo, tmp_path / "cache", tmp_path, "ray")
