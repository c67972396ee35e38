"""`flashbench run` and `flashbench submit` (flashbench/cli/run.py) through click's test runner, on a
copy of the repository so nothing is written into the real one."""

import json
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from flashbench.calibrate import save_calibration
from flashbench.cli import main
from flashbench.cli import run as run_command
from flashbench.environment import hardware_name
from flashbench.model import RunReport
from flashbench.run import RunResult
from flashbench.run.pool import DEVICE_THREAD
from flashbench.traces import trace_path
from trace_factory import CALIBRATION, make_trace

DEFINITION = "mla_paged_decode_h16_ckv512_kpe64_ps1"
FIXTURES = Path(__file__).parent / "fixtures" / "solutions" / DEFINITION
FAST = ["--device", "cpu", "--iters", "2", "--warmup", "0", "--timeout", "60"]


def invoke(root: Path, *arguments):
    return CliRunner().invoke(main, ["--root", str(root), *arguments])


def unwrapped(text: str) -> str:
    """Text without whitespace: the console wraps long lines at a space (which goes) or inside a long path."""
    return "".join(text.split())


def test_run_prints_the_summary_and_records_traces(module_repo, tmp_path):
    trace_dir = tmp_path / "traces"
    result = invoke(module_repo, "run", "--def", "mla_paged_decode", "--solution", str(FIXTURES / "correct_dps"),
                    "--trace-dir", str(trace_dir), *FAST)
    assert result.exit_code == 0, result.output
    assert "results" in result.output
    progress, table = result.output.split("results", 1)
    # Not a terminal: a line as each candidate starts its build, a line per finished job, then the summary table.
    lines = [line for line in progress.splitlines() if line.strip()]
    assert [line for line in lines if "building" in line] == ["reference: building", "correct_dps: building"]
    assert sorted(line.split()[:3] for line in lines if "building" not in line) == sorted(
        [name, workload, "PASSED"] for name in ("reference", "correct_dps") for workload in ("smoke_empty_short", "smoke_mixed"))
    rows = [line for line in table.splitlines() if "PASSED" in line]
    assert len(rows) == 4  # reference and correct_dps on both smoke workloads
    assert sum("correct_dps" in row for row in rows) == 2 and sum("reference" in row for row in rows) == 2
    assert all("smoke_empty_short" in row or "smoke_mixed" in row for row in rows)
    assert all("µs" in row for row in rows)
    (trace_file,) = trace_dir.glob(f"*/{DEFINITION}.jsonl")
    assert unwrapped(f"traces: {trace_file}") in unwrapped(result.output)
    assert [json.loads(line)["status"] for line in trace_file.read_text().splitlines()] == ["PASSED"] * 4
    assert not (module_repo / "traces").exists()


def test_an_invalid_folder_under_solutions_is_skipped_and_the_others_run(fresh_repo, tmp_path):
    """One folder with a bad manifest stopped every run of its definition: now it is named on one line,
    the others run, and the exit status says something was left out."""
    solutions = fresh_repo / "solutions" / DEFINITION
    shutil.rmtree(solutions, ignore_errors=True)
    solutions.mkdir(parents=True)
    shutil.copytree(FIXTURES / "correct_dps", solutions / "correct_dps")
    shutil.copytree(FIXTURES.parent / "_shared" / "decode_support", fresh_repo / "solutions" / "_shared" / "decode_support")
    (solutions / "bad").mkdir()
    (solutions / "bad" / "solution.yaml").write_text("name: bad\nbogus: 1\n")
    result = invoke(fresh_repo, "run", "--def", "mla_paged_decode", "--workload", "smoke_mixed",
                    "--trace-dir", str(tmp_path), *FAST)
    assert result.exit_code == 1, result.output
    output = unwrapped(result.output)
    assert unwrapped(f"skipped an invalid solution folder: {solutions / 'bad' / 'solution.yaml'}: definition: Field required") in output
    assert "correct_dps smoke_mixed PASSED" in result.output
    assert unwrapped("0 of 2 pair(s) did not pass; 1 invalid solution folder(s) skipped") in output


def test_run_with_an_unknown_solution_is_one_line_and_exit_2(module_repo, tmp_path):
    result = invoke(module_repo, "run", "--def", "mla_paged_decode", "--solution", "no_such_solution",
                    "--trace-dir", str(tmp_path), *FAST)
    assert result.exit_code == 2
    assert "no solution 'no_such_solution'" in result.output
    assert "Traceback" not in result.output


def test_run_exits_1_when_a_pair_fails_and_prints_one_json_document(module_repo, tmp_path):
    result = invoke(module_repo, "run", "--def", "mla_paged_decode", "--solution", str(FIXTURES / "wrong_values"),
                    "--workload", "smoke_mixed", "--trace-dir", str(tmp_path), "--json", *FAST)
    assert result.exit_code == 1, result.output
    document = json.loads(result.stdout)  # stdout holds the document and nothing else
    (trace_file,) = tmp_path.glob(f"*/{DEFINITION}.jsonl")
    assert document["format_version"] == "flashbench.run/1" and document["command"] == "run"
    assert document["definition"] == DEFINITION and document["devices"] == ["cpu"]
    assert document["timing_method"] == "host clock" and document["trace_file"] == str(trace_file)
    assert (document["passed"], document["failed"], document["interrupted"]) == (1, 1, False)
    reference, wrong = document["results"]
    assert reference["status"] == "PASSED" and reference["timing"]["method"] == "host clock"
    assert reference["timing"]["p10_ms"] <= reference["timing"]["latency_ms"] <= reference["timing"]["p90_ms"]
    assert reference["speedup"] == 1.0 and reference["bytes"] > 0 and reference["floor_ms"] is None
    assert wrong["status"] == "INCORRECT_NUMERICAL" and wrong["timing"] is None
    assert wrong["errors"]["output"]["mismatch_fraction"] > 0 and wrong["workload"]["name"] == "smoke_mixed"
    assert wrong["trace_file"] == str(trace_file)
    # What is meant for people went to stderr: the line per job, the table, the reason for exit 1.
    assert "results" in result.stderr and "1 of 2 pair(s) did not pass" in result.stderr


def test_a_failed_pairs_traceback_is_printed_under_the_summary(module_repo, tmp_path):
    """The message is one line; a newcomer's traceback was only in the trace file's log."""
    result = invoke(module_repo, "run", "--def", "mla_paged_decode", "--solution", str(FIXTURES / "raises"),
                    "--workload", "smoke_mixed", "--trace-dir", str(tmp_path), *FAST)
    assert result.exit_code == 1, result.output
    assert "log of raises on smoke_mixed (RUNTIME_ERROR), last" in result.output
    assert "Traceback" in result.output or "deliberate failure in the fixture" in result.output.split("log of raises")[1]


def test_submit_a_correct_solution_copies_it_and_records_its_traces(module_repo, tmp_path):
    result = invoke(module_repo, "submit", str(FIXTURES / "correct_dps"), "--trace-dir", str(tmp_path), "--json", *FAST)
    assert result.exit_code == 0, result.output
    target = module_repo / "solutions" / DEFINITION / "correct_dps"
    assert f"submitted to solutions/{DEFINITION}/correct_dps" in result.stderr
    assert sorted(p.name for p in target.iterdir()) == ["kernel.py", "solution.yaml"]
    for name in ("kernel.py", "solution.yaml"):
        assert (target / name).read_bytes() == (FIXTURES / "correct_dps" / name).read_bytes()
    (trace_file,) = tmp_path.glob(f"*/{DEFINITION}.jsonl")
    assert sorted(json.loads(line)["solution"] for line in trace_file.read_text().splitlines()) == [
        "correct_dps", "correct_dps", "reference", "reference"]
    document = json.loads(result.stdout)
    assert document["command"] == "submit" and document["submitted_to"] == f"solutions/{DEFINITION}/correct_dps"
    assert document["trace_file"] == str(trace_file) and document["failed"] == 0
    assert not (module_repo / "traces").exists()


def test_submit_of_wrong_values_exits_1_and_copies_nothing(module_repo, tmp_path):
    result = invoke(module_repo, "submit", str(FIXTURES / "wrong_values"), "--trace-dir", str(tmp_path), *FAST)
    assert result.exit_code == 1, result.output
    (line,) = [line for line in result.stderr.splitlines() if "not submitted" in line]
    assert "not submitted: INCORRECT_NUMERICAL on smoke_" in line and str(FIXTURES / "wrong_values") in line
    assert not (module_repo / "solutions" / DEFINITION / "wrong_values").exists()
    (trace_file,) = tmp_path.glob(f"*/{DEFINITION}.jsonl")
    assert "INCORRECT_NUMERICAL" in trace_file.read_text()  # the failure is recorded too


def test_submit_names_a_hostile_folder_as_text(module_repo, tmp_path):
    """A path through folders `a[` and `x]` read as rich markup ("[/x]") and ended the command with a traceback;
    a folder's escape sequences reached the terminal."""
    folder = tmp_path / "a[" / "x]\x1b]0;title\x07y"
    shutil.copytree(FIXTURES / "wrong_values", folder)
    shutil.copytree(FIXTURES.parent / "_shared", tmp_path / "_shared")  # its decode_support, at ../../_shared
    result = invoke(module_repo, "submit", str(folder), "--trace-dir", str(tmp_path / "traces"), *FAST)
    assert result.exit_code == 1, result.output
    (line,) = [line for line in result.stderr.splitlines() if "not submitted" in line]
    assert line.startswith(f"{tmp_path}/a[/x]?]0;title?y: not submitted: INCORRECT_NUMERICAL")
    assert "\x1b" not in result.output and "Traceback" not in result.output


def test_submit_under_the_name_of_a_repository_solution_with_other_code_exits_2_before_running(fresh_repo,
                                                                                             tmp_path):
    """A failed submit recorded its traces under the name, and so took that solution's board row."""
    repository = Path(__file__).resolve().parents[1]
    shutil.copytree(repository / "solutions" / DEFINITION / "torch_vectorized",
                    fresh_repo / "solutions" / DEFINITION / "torch_vectorized")
    impostor = tmp_path / "solutions" / DEFINITION / "impostor"
    shutil.copytree(FIXTURES / "wrong_values", impostor, symlinks=True)
    shutil.copytree(FIXTURES.parent / "_shared", tmp_path / "solutions" / "_shared")  # its decode_support
    manifest = yaml.safe_load((impostor / "solution.yaml").read_text())
    (impostor / "solution.yaml").write_text(yaml.safe_dump({**manifest, "name": "torch_vectorized"}))
    result = invoke(fresh_repo, "submit", str(impostor), "--trace-dir", str(tmp_path / "traces"), *FAST)
    assert result.exit_code == 2, result.output
    assert "is taken by" in result.output and "results" not in result.output
    assert not (tmp_path / "traces").exists()


def test_submit_of_a_name_differing_from_a_repository_solutions_only_in_case_exits_2_before_running(fresh_repo,
                                                                                                     tmp_path):
    """On a case-insensitive file system the two names are one folder: submitting Torch_vectorized would have
    replaced torch_vectorized (the same code too: the name is what is refused)."""
    repository = Path(__file__).resolve().parents[1]
    original = fresh_repo / "solutions" / DEFINITION / "torch_vectorized"
    shutil.copytree(repository / "solutions" / DEFINITION / "torch_vectorized", original)
    twin = tmp_path / "Torch_vectorized"
    shutil.copytree(original, twin)
    manifest = yaml.safe_load((twin / "solution.yaml").read_text())
    (twin / "solution.yaml").write_text(yaml.safe_dump({**manifest, "name": "Torch_vectorized"}))
    result = invoke(fresh_repo, "submit", str(twin), "--trace-dir", str(tmp_path / "traces"), *FAST)
    assert result.exit_code == 2, result.output
    assert "'Torch_vectorized' differs from 'torch_vectorized'" in result.output and "only in case" in result.output
    assert "results" not in result.output and not (tmp_path / "traces").exists()
    assert [p.name for p in original.parent.iterdir()] == ["torch_vectorized"]


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


COMMANDS = {
    "run": ["run", "--def", "mla_paged_decode"],
    "submit": ["submit", str(FIXTURES / "correct_dps")],
    "calibrate": ["calibrate"],
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("device, message", [
    ("cuda", "--device cuda: no CUDA device is visible; run with --device cpu, or on a machine with a GPU"),
    ("cuda:7", "--device cuda:7: no CUDA device is visible; run with --device cpu, or on a machine with a GPU"),
    ("gpu", "--device 'gpu' is not a device flashbench runs on; give cpu, cuda or cuda:N"),
    ("tpu", "--device 'tpu' is not a device flashbench runs on; give cpu, cuda or cuda:N"),
    ("cuda:x", "--device 'cuda:x' is not a device flashbench runs on; give cpu, cuda or cuda:N"),
])
def test_a_device_this_machine_lacks_is_one_line_and_exit_2(module_repo, tmp_path, monkeypatch, command, device, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = invoke(module_repo, *COMMANDS[command], "--device", device, "--trace-dir", str(tmp_path))
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"error: {message}"] and result.stdout == ""  # nothing ran


@pytest.mark.parametrize("command", COMMANDS)
def test_a_gpu_index_past_the_visible_ones_is_one_line_and_exit_2(module_repo, tmp_path, monkeypatch, command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    result = invoke(module_repo, *COMMANDS[command], "--device", "cuda:7", "--trace-dir", str(tmp_path))
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == ["error: --device cuda:7: no GPU 7, 2 visible; give cuda:0 to cuda:1"]


# A Runner standing in for flashbench.run's: it records the given traces through on_result, as the real
# one does per recorded trace, then returns them, or raises KeyboardInterrupt (a Ctrl-C) instead.

def cpu_trace(solution, workload, status="PASSED", latency_ms=1.0):
    timing = {"method": "host clock", "warmup": 0, "iters": 2, "l2_flush_bytes": 0}
    trace = make_trace(solution, workload, latency_ms=latency_ms if status == "PASSED" else None, status=status,
                       hardware=hardware_name("cpu"), timing=timing, device="cpu", definition=DEFINITION)
    return trace.model_copy(update={"workload_name": workload, "message": "" if status == "PASSED" else "why"})


@pytest.fixture
def fake_runner(monkeypatch):
    def install(traces, interrupt=False, skipped=(), terminate=False):
        class FakeRunner:
            def __init__(self, repo, definition, options, on_result):
                self.on_result = on_result
                self.trace_file = trace_path(options.trace_dir, hardware_name("cpu"), definition, options.timing)

            def candidates(self, folders):
                return ["reference", *folders]

            def run(self, candidates, workloads, advance, on_phase):
                for trace in traces:
                    self.on_result(trace)
                    advance()
                if interrupt:
                    raise KeyboardInterrupt
                if terminate:  # as `timeout` or CI ends a command
                    os.kill(os.getpid(), signal.SIGTERM)
                    threading.Event().wait(5)  # the handler raises here
                return RunResult(traces=list(traces), trace_file=self.trace_file, isolation="process",
                                 skipped=list(skipped))

        monkeypatch.setattr(run_command, "Runner", FakeRunner)
    return install


def run_fake(root, trace_dir, *arguments):
    return invoke(root, "run", "--def", "mla_paged_decode", "--solution", "reference", "--device", "cpu",
                  "--trace-dir", str(trace_dir), *arguments)


@pytest.mark.parametrize("status, arguments, code", [
    ("PASSED", [], 0),
    ("INCORRECT_NUMERICAL", [], 1),
    ("MISSING_DEPENDENCY", [], 1),  # a run that could not check a solution did not pass
    ("TIMEOUT", ["--allow-fail"], 0),
    ("MISSING_DEPENDENCY", ["--allow-fail"], 0),
])
def test_exit_codes_of_run(module_repo, tmp_path, fake_runner, status, arguments, code):
    fake_runner([cpu_trace("reference", "smoke_mixed"), cpu_trace("reference", "smoke_empty_short", status)])
    result = run_fake(module_repo, tmp_path, *arguments)
    assert result.exit_code == code, result.output
    assert ("1 of 2 pair(s) did not pass" in result.stderr) == (code == 1)


def test_a_failure_skipped_by_resume_still_fails_the_run(module_repo, tmp_path, fake_runner):
    fake_runner([cpu_trace("reference", "smoke_mixed")], skipped=[cpu_trace("reference", "smoke_empty_short", "TIMEOUT")])
    result = run_fake(module_repo, tmp_path, "--resume", "--json")
    assert result.exit_code == 1
    assert "1 of 2 pair(s) did not pass (1 recorded before this run, --resume)" in result.stderr
    assert "1 pair(s) already recorded were skipped (--resume), 1 of them not PASSED" in result.stderr
    report = json.loads(result.stdout)
    assert (report["skipped"], report["skipped_failed"], report["passed"]) == (1, 1, 1)


def test_ctrl_c_summarises_what_finished_and_prints_the_command_that_resumes(module_repo, tmp_path, fake_runner):
    fake_runner([cpu_trace("reference", "smoke_mixed"), cpu_trace("reference", "smoke_empty_short", "RUNTIME_ERROR")],
                interrupt=True)
    result = invoke(module_repo, "run", "--def", "mla_paged_decode", "--solution", "reference", "--workload", "smoke",
                    "--device", "cpu", "--iters", "3", "--trace-dir", str(tmp_path / "my traces"))
    assert result.exit_code == 130, result.output
    rows = result.stdout.split("results", 1)[1]
    assert "smoke_mixed" in rows and "PASSED" in rows and "smoke_empty_short" in rows and "RUNTIME_ERROR" in rows
    assert result.stderr.splitlines()[-1] == (
        "interrupted after 2 finished pair(s); continue with: flashbench --root " + str(module_repo) +
        f" run --def mla_paged_decode --solution reference --workload smoke --device cpu --iters 3 --trace-dir "
        f"'{tmp_path / 'my traces'}' --resume")
    assert "Traceback" not in result.output


def test_ctrl_c_with_a_device_thread_still_running_leaves_with_130_without_the_interpreters_shutdown(
        module_repo, tmp_path, fake_runner, monkeypatch):
    # A device thread still in the judge's own work when the pool stopped waiting: the shutdown under it
    # could abort in CUDA's code, so the command leaves at once (os._exit), its output flushed first.
    fake_runner([cpu_trace("reference", "smoke_mixed")], interrupt=True)
    held = threading.Event()
    thread = threading.Thread(target=held.wait, name=DEVICE_THREAD + "cuda:0", daemon=True)
    thread.start()
    left_with = []

    def leave(code):
        left_with.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(run_command.os, "_exit", leave)
    try:
        result = run_fake(module_repo, tmp_path)
    finally:
        held.set()
        thread.join()
    assert left_with == [130] and result.exit_code == 130, result.output
    assert result.stderr.splitlines()[-1].startswith("interrupted after 1 finished pair(s); continue with:")
    left_with.clear()
    fake_runner([cpu_trace("reference", "smoke_mixed")], interrupt=True)  # no thread left: the usual exit
    assert run_fake(module_repo, tmp_path).exit_code == 130 and left_with == []


def test_sigterm_ends_a_run_as_ctrl_c_does(module_repo, tmp_path, fake_runner):
    """`timeout` and CI send SIGTERM: the run ended with no summary, no way to continue, and its workers'
    folders left behind."""
    fake_runner([cpu_trace("reference", "smoke_mixed")], terminate=True)
    before = signal.getsignal(signal.SIGTERM)
    result = run_fake(module_repo, tmp_path)
    assert signal.getsignal(signal.SIGTERM) is before  # a program that embeds the command keeps its own
    assert result.exit_code == 130, result.output
    assert result.stderr.splitlines()[-1].startswith("interrupted after 1 finished pair(s); continue with:")


def test_ctrl_c_with_json_prints_the_partial_document(module_repo, tmp_path, fake_runner):
    fake_runner([cpu_trace("reference", "smoke_mixed")], interrupt=True)
    result = run_fake(module_repo, tmp_path, "--json", "--resume")
    assert result.exit_code == 130, result.output
    document = json.loads(result.stdout)
    assert document["interrupted"] is True and [r["workload"]["name"] for r in document["results"]] == ["smoke_mixed"]
    assert result.stderr.splitlines()[-1].count("--resume") == 1  # given already, not added twice


def test_ctrl_c_before_any_pair_ran_exits_130(module_repo, tmp_path, fake_runner, monkeypatch):
    def interrupted(*arguments):
        raise KeyboardInterrupt
    monkeypatch.setattr(run_command, "select_workloads", interrupted)
    result = run_fake(module_repo, tmp_path)
    assert result.exit_code == 130 and result.stderr.splitlines() == ["interrupted"]


def test_json_floors_come_from_the_calibration(module_repo, tmp_path, fake_runner):
    save_calibration(CALIBRATION.model_copy(update={"hardware": hardware_name("cpu")}), tmp_path)
    fake_runner([cpu_trace("reference", "smoke_mixed", latency_ms=4.0)])  # 1e9 bytes at 1e12 B/s: a 1 ms floor
    result = run_fake(module_repo, tmp_path, "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["calibration"]["memory_bytes_per_s"] == 1e12
    (pair,) = document["results"]
    assert pair["floor_ms"] == pytest.approx(1.0) and pair["percent_of_floor"] == pytest.approx(25.0)
    assert RunReport.model_validate(document).results[0].solution == "reference"  # the model reads its own output


def test_the_table_shows_timing_method_and_spread_and_no_rate_from_a_host_clock(module_repo, tmp_path, fake_runner):
    fake_runner([cpu_trace("reference", "smoke_mixed", latency_ms=0.5)])
    result = run_fake(module_repo, tmp_path)
    (row,) = [line for line in result.stdout.split("results", 1)[1].splitlines() if "smoke_mixed" in line]
    assert "host clock" in row and "500.0–500.0" in row and "—" in row
    assert "GB/s" not in result.stdout and "TFLOP/s" not in result.stdout


def test_rates_from_a_gpu_clock_never_read_as_zero():
    perf = make_trace("s", "w", latency_ms=1.0, nbytes=2e6, flops=3e6).performance  # 2 GB/s, 0.003 TFLOP/s
    assert run_command.achieved(perf) == "2 GB/s, 0.003 TFLOP/s"
    assert run_command.achieved(perf.model_copy(update={"bytes": None, "flops": None})) == "—"


@pytest.mark.parametrize("variable, value, message", [
    ("FLASHBENCH_ISOLATION", "chroot", "FLASHBENCH_ISOLATION='chroot' is not one of namespaces, process"),
    ("FLASHBENCH_WORKER_UID", "abc", "FLASHBENCH_WORKER_UID='abc' is no uid"),
])
def test_a_machine_setting_refused_ends_the_run_in_one_line(module_repo, tmp_path, monkeypatch, variable, value,
                                                             message):
    """The sandbox's refusals of the machine's settings ended `run` in a traceback."""
    monkeypatch.setenv(variable, value)
    if variable == "FLASHBENCH_WORKER_UID":  # read only where the runner is root
        monkeypatch.setattr("flashbench.run.sandbox.os.geteuid", lambda: 0)
    result = invoke(module_repo, "run", "--def", "mla_paged_decode", "--solution", str(FIXTURES / "correct_dps"),
                    "--workload", "smoke_mixed", "--trace-dir", str(tmp_path / "traces"), *FAST)
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
