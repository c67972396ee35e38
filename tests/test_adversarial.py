"""The adversarial corpus (tests/fixtures/adversarial.yaml) through the runner on the smoke
workloads: every entry gets its recorded verdict on every workload, a correct solution after
the entries of each group still passes, and the trace file holds only what the runner wrote.

Entries marked `cuda` run only where a GPU is present; the others run on the CPU everywhere.
The same entries can be run one by one through the CLI:
    flashbench run --def mla_paged_decode --workload smoke \
        --solution tests/fixtures/solutions/mla_paged_decode_h16_ckv512_kpe64_ps1/<name>
"""

import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import yaml

from flashbench import Repo
from flashbench.run import RunOptions, Runner, select_solutions, select_workloads
from flashbench.traces import read_traces

DEFINITION = "mla_paged_decode_h16_ckv512_kpe64_ps1"
FIXTURES = Path(__file__).parent / "fixtures"
SOLUTIONS = FIXTURES / "solutions" / DEFINITION
CORPUS = yaml.safe_load((FIXTURES / "adversarial.yaml").read_text())
RECORDS = {record["name"]: record for record in CORPUS["entries"]}
SMOKE = ["smoke_empty_short", "smoke_mixed"]
CONTROL = "correct_dps"
STATUSES = {"PASSED", "INCORRECT_SHAPE", "INCORRECT_DTYPE", "INCORRECT_NUMERICAL", "RUNTIME_ERROR", "COMPILE_ERROR",
            "INVALID_SOLUTION", "CRASHED", "TIMEOUT", "MISSING_DEPENDENCY", "REJECTED"}
ON_GPU = torch.cuda.is_available()

# What an attacker is told (standing for a path it guessed); the runner never passes these on.
TRACE_FILE_VARIABLE = "FLASHBENCH_ATTACK_TRACE_FILE"
REFERENCE_CACHE_VARIABLE = "FLASHBENCH_ATTACK_REFERENCE_CACHE"
FORGED_MARKER = "forged-by-writes_traces"  # what writes_traces puts in its fake line
SLEEPING_CHILD = [sys.executable, "-c", "import time; time.sleep(600)"]  # what spawns_child starts

# Entries that need options of their own share a Runner; every other cpu entry goes to "outputs".
PROCESS = ["crash_segfault", "exit_at_import", "sys_exit_at_import", "sys_exit_at_call", "raises", "bad_entry",
           "missing_dep", "patches_perf_counter", "patches_cuda_event", "huge_allocation", "spawns_child", "hang"]
FILES = ["writes_traces", "writes_reference_cache"]
OPTIONS = {
    "outputs": {"timeout": 60.0},
    # An address-space limit makes huge_allocation fail fast; a short timeout bounds hang.
    "process": {"timeout": 10.0, "memory_limit_bytes": 8 << 30},
    "files": {"timeout": 60.0},
    "cuda": {"device": "cuda", "timeout": 120.0, "iters": 10, "warmup": 2},
}


def groups() -> dict[str, list[str]]:
    """Entry names by group, the control last in each; cuda entries only where a GPU is present."""
    cpu = [name for name, record in RECORDS.items() if record["device"] == "cpu" and name != CONTROL]
    chosen = {
        "outputs": [name for name in cpu if name not in PROCESS + FILES],
        "process": [name for name in cpu if name in PROCESS],
        "files": [name for name in cpu if name in FILES],
    }
    if ON_GPU:
        chosen["cuda"] = [name for name, record in RECORDS.items() if record["device"] == "cuda"]
    return {group: names + [CONTROL] for group, names in chosen.items()}


def acceptable(record: dict) -> list[str]:
    expected = record["expected"]
    return expected if isinstance(expected, list) else [expected]


@dataclass
class Outcome:
    traces: dict = field(default_factory=dict)  # (name, workload) -> traces, one per group it ran in
    order: dict = field(default_factory=dict)  # group -> solution names in the order they ran
    trace_files: set = field(default_factory=set)
    written: int = 0  # traces the runner appended
    tmp: Path | None = None  # a folder of traces and reference outputs for each group


def runner_for(repo_root: Path, cache: Path, tmp: Path, **options) -> Runner:
    settings = {"device": "cpu", "iters": 2, "warmup": 0, "input_sets": 2, "trace_dir": tmp / "traces",
                "cache_dir": cache, "reference_cache_dir": tmp / "references", **options}
    return Runner(Repo(repo_root), DEFINITION, RunOptions(**settings))


def run_group(runner: Runner, names: list[str]):
    repo = runner.repo
    folders = select_solutions(repo, DEFINITION, [str(SOLUTIONS / name) for name in names])
    workloads = select_workloads(repo, DEFINITION, SMOKE, runner.options.device)
    return runner.run(runner.candidates(folders)[1:], workloads)  # [0] is the reference


@pytest.fixture(scope="module")
def adversarial_run(repo_copy, shared_cache, tmp_path_factory) -> Outcome:
    """"outputs" and "process" run side by side (each with traces and references of its own);
    "files" then attacks the trace file and the filled reference cache of "outputs"."""
    tmp = tmp_path_factory.mktemp("adversarial")
    outcome = Outcome(tmp=tmp)
    chosen = groups()
    runners = {group: runner_for(repo_copy, shared_cache, tmp / ("outputs" if group == "files" else group),
                                 **OPTIONS[group]) for group in chosen}

    def run(group: str):
        return group, run_group(runners[group], chosen[group])

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TRACE_FILE_VARIABLE, str(runners["files"].trace_file))
        patch.setenv(REFERENCE_CACHE_VARIABLE, str(runners["files"].reference_cache))
        with ThreadPoolExecutor(max_workers=2) as pool:
            results = list(pool.map(run, ["outputs", "process"]))
        results += [run(group) for group in chosen if group not in ("outputs", "process")]
    for group, result in results:
        for trace in result.traces:
            outcome.traces.setdefault((trace.solution, trace.workload_name), []).append(trace)
        outcome.order[group] = list(dict.fromkeys(trace.solution for trace in result.traces))
        outcome.trace_files.add(result.trace_file)
        outcome.written += len(result.traces)
    return outcome


# The corpus itself.

def test_every_record_has_a_folder_and_every_folder_a_record():
    folders = {p.name for p in SOLUTIONS.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    assert sorted(folders - set(RECORDS)) == [], "folders without a record in adversarial.yaml"
    assert sorted(set(RECORDS) - folders) == [], "records without a folder"
    assert len(RECORDS) == len(CORPUS["entries"]), "a name is recorded twice"


@pytest.mark.parametrize("name", RECORDS)
def test_record_is_well_formed(name):
    record = RECORDS[name]
    assert set(record) <= {"name", "expected", "message", "device", "attack"}
    assert set(acceptable(record)) <= STATUSES
    assert record["device"] in ("cpu", "cuda")
    assert record["attack"].strip()


# Verdicts.

@pytest.mark.parametrize("name", RECORDS)
def test_verdict(adversarial_run, name):
    record = RECORDS[name]
    if record["device"] == "cuda" and not ON_GPU:
        pytest.skip("needs a GPU")
    for workload in SMOKE:
        traces = adversarial_run.traces.get((name, workload))
        assert traces, f"{name} did not run on {workload}"
        for trace in traces:
            described = f"{name} on {workload}: {trace.status} {trace.message!r}"
            assert trace.status in acceptable(record), described
            if "message" in record and trace.status != "PASSED":
                assert record["message"] in trace.message, described
            if trace.status == "PASSED":
                assert trace.performance is not None and trace.performance.latency_ms > 0, described
            else:
                assert trace.performance is None, described


def test_the_control_runs_last_in_every_group(adversarial_run):
    for group, names in groups().items():
        assert adversarial_run.order[group] == names, group
    assert len(adversarial_run.traces[(CONTROL, SMOKE[0])]) == len(groups())


# What the entries must not leave behind.

def test_the_trace_file_holds_only_what_the_runner_wrote(adversarial_run, capsys):
    capsys.readouterr()
    traces = [trace for path in adversarial_run.trace_files for trace in read_traces(path)]
    assert capsys.readouterr().err == "", "a line of the trace file is not a valid trace"
    assert len(traces) == adversarial_run.written
    for path in adversarial_run.trace_files:
        assert FORGED_MARKER not in path.read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_no_child_process_outlives_its_solution(adversarial_run):
    assert adversarial_run.traces[("spawns_child", SMOKE[0])]  # it did run
    wanted = "\0".join(SLEEPING_CHILD).encode() + b"\0"
    running = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if cmdline.read_bytes() == wanted:
                running.append(cmdline.parent.name)
        except OSError:
            continue
    assert running == [], f"spawns_child's child still runs as pid {', '.join(running)}"


@pytest.mark.xfail(strict=True, reason="only one variant-0 reference entry per workload is recomputed in a "
                                       "run; the others are trusted as found on disk")
def test_a_poisoned_reference_cache_does_not_reach_a_later_run(adversarial_run, repo_copy, shared_cache):
    """writes_reference_cache overwrote the cache the "files" group used; a new run on that cache
    must still judge a correct solution by the reference."""
    runner = runner_for(repo_copy, shared_cache, adversarial_run.tmp / "outputs", save=False, **OPTIONS["files"])
    result = run_group(runner, [CONTROL])
    assert [(t.workload_name, t.status, t.message) for t in result.traces] == [(w, "PASSED", "") for w in SMOKE]
