"""`flashbench run` and `flashbench submit` (flashbench/cli/run.py) through click's test runner, on a
copy of the repository so nothing is written into the real one."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashbench.cli import main

DEFINITION = "mla_paged_decode_h16_ckv512_kpe64_ps1"
FIXTURES = Path(__file__).parent / "fixtures" / "solutions" / DEFINITION
FAST = ["--device", "cpu", "--iters", "2", "--warmup", "0", "--timeout", "60"]


def invoke(root: Path, *arguments):
    return CliRunner().invoke(main, ["--root", str(root), *arguments])


def test_run_prints_the_summary_and_records_traces(module_repo, tmp_path):
    trace_dir = tmp_path / "traces"
    result = invoke(module_repo, "run", "--def", "mla_paged_decode", "--solution", str(FIXTURES / "correct_dps"),
                    "--trace-dir", str(trace_dir), *FAST)
    assert result.exit_code == 0, result.output
    assert "results" in result.output
    progress, table = result.output.split("results", 1)
    # Not a terminal: a line per finished job as it ends, then the summary table.
    assert sorted(line.split()[:3] for line in progress.splitlines() if line.strip()) == sorted(
        [name, workload, "PASSED"] for name in ("reference", "correct_dps") for workload in ("smoke_empty_short", "smoke_mixed"))
    rows = [line for line in table.splitlines() if "PASSED" in line]
    assert len(rows) == 4  # reference and correct_dps on both smoke workloads
    assert sum("correct_dps" in row for row in rows) == 2 and sum("reference" in row for row in rows) == 2
    assert all("smoke_empty_short" in row or "smoke_mixed" in row for row in rows)
    assert all("µs" in row for row in rows)
    (trace_file,) = trace_dir.glob(f"*/{DEFINITION}.jsonl")
    assert f"traces: {trace_file}" in result.output.replace("\n", "")
    assert [json.loads(line)["status"] for line in trace_file.read_text().splitlines()] == ["PASSED"] * 4
    assert not (module_repo / "traces").exists()


def test_run_with_an_unknown_solution_is_one_line_and_exit_2(module_repo, tmp_path):
    result = invoke(module_repo, "run", "--def", "mla_paged_decode", "--solution", "no_such_solution",
                    "--trace-dir", str(tmp_path), *FAST)
    assert result.exit_code == 2
    assert "no solution 'no_such_solution'" in result.output
    assert "Traceback" not in result.output


def test_submit_a_correct_solution_copies_it(module_repo):
    result = invoke(module_repo, "submit", str(FIXTURES / "correct_dps"), *FAST)
    assert result.exit_code == 0, result.output
    target = module_repo / "solutions" / DEFINITION / "correct_dps"
    assert f"submitted to solutions/{DEFINITION}/correct_dps" in result.output
    assert sorted(p.name for p in target.iterdir()) == ["kernel.py", "solution.yaml"]
    for name in ("kernel.py", "solution.yaml"):
        assert (target / name).read_bytes() == (FIXTURES / "correct_dps" / name).read_bytes()
    assert not (module_repo / "traces").exists()  # submit records no traces


def test_submit_of_wrong_values_exits_2_and_copies_nothing(module_repo):
    result = invoke(module_repo, "submit", str(FIXTURES / "wrong_values"), *FAST)
    assert result.exit_code == 2, result.output
    assert "not submitted: INCORRECT_NUMERICAL" in result.output
    assert not (module_repo / "solutions" / DEFINITION / "wrong_values").exists()


def test_submit_of_an_invalid_folder_exits_2_before_running(module_repo):
    result = invoke(module_repo, "submit", str(FIXTURES / "bad_entry"), *FAST)
    assert result.exit_code == 2, result.output
    assert "does_not_exist" in result.output
    assert "results" not in result.output  # rejected by validation, nothing was run
    assert not (module_repo / "solutions" / DEFINITION / "bad_entry").exists()


def test_run_on_two_cpu_devices(module_repo, tmp_path):
    result = invoke(module_repo, "run", "--def", "mla_paged_decode", "--solution", str(FIXTURES / "correct_dps"),
                    "--workload", "smoke_mixed", "--trace-dir", str(tmp_path), "--devices", "cpu:2", *FAST[2:])
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.split("results", 1)[1].splitlines() if "PASSED" in line]
    assert len(rows) == 2 and "reference" in rows[0] and "correct_dps" in rows[1]
    (trace_file,) = tmp_path.glob(f"*/{DEFINITION}.jsonl")
    assert len(trace_file.read_text().splitlines()) == 2


@pytest.mark.parametrize("arguments, message", [
    (["--device", "cpu", "--devices", "cpu:2"], "give --device or --devices, not both"),
    (["--devices", "cpu:2", "--backend", "ray"], "--devices is for the local backend"),
    (["--address", "auto"], "--address is for --backend ray"),
    (["--devices", "gpu0"], "'gpu0' is not all, a GPU index, cuda:N, cpu or cpu:N"),
])
def test_device_options_that_do_not_fit_are_one_line_and_exit_2(module_repo, tmp_path, arguments, message):
    result = invoke(module_repo, "run", "--def", "mla_paged_decode", "--trace-dir", str(tmp_path), *arguments)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
