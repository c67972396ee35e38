"""The adversarial corpus (tests/fixtures/adversarial.yaml) through the runner on the smoke
workloads: every entry gets its recorded verdict on every workload, with a message saying what
went wrong, each pair recorded in order (the trace file agreeing); a correct solution after the
entries of each group still passes and is timed; and nothing an entry tried outlives the run: no
process, no file in the trace directory, no exchange directory, no evidence of code run in the
runner. docs/threat_model.md describes the attack classes and the defence each meets. (This module
and tests/test_adversarial_outputs.py, which runs the groups of wrong outputs, are the suite's one run of
the corpus: tests/test_runner.py's checks of how the runner reports these failures are here too.)

The fixtures run from a copy (symbolic links kept), into which the test writes each folder's
`targets.json`: the paths a fixture aims at (the run's trace file, the repository copy's
reference...). The worker's environment is an allow-list, so this is how a fixture learns what a
real attacker would have to guess.

Entries marked `isolation: namespaces` promise `expected` only at that level. Those with a
`process_level` verdict sabotage themselves when their attack gets through, so they pass only
where the sandbox stopped them; where the machine allows namespaces they run once more at level
"process" (group "unsandboxed"), where `process_level` must hold: the attacks are real. Where the
kernel has Landlock, which confines a worker's writes at level process too, an entry's
`confined_process_level` holds there instead, when it has one (the file-writing attacks, which
Landlock stops). Those without `process_level` are not run at level process (daemon_double_fork's
daemon would escape and disturb the entries after it).

Entries marked `cuda` run only where a GPU is present; the others run on the CPU everywhere.
An entry can be run alone through the CLI (file-aiming ones then aim at nothing):
    flashbench run --def mla_paged_decode --workload smoke \\
        --solution tests/fixtures/solutions/mla_paged_decode_h16_ckv512_kpe64_ps1/<name>
"""

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import yaml
from conftest import copy_repo

from flashbench import FlashbenchError, Repo
from flashbench.run import RunOptions, Runner, sandbox, select_solutions, select_workloads
from flashbench.run.recorder import UNTRUSTED_SUFFIX
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
SELECTION_ERROR = "SELECTION_ERROR"  # refused when selected: no job, no trace
LEVELS = ("namespaces", "process")
ON_GPU = torch.cuda.is_available()
# The module's runs (about two minutes on two cores) happen in the set-up of its first test.
pytestmark = pytest.mark.timeout(900)

# What the fixtures leave, and where the test looks for it.
SECRET_VARIABLE = "FLASHBENCH_ATTACK_SECRET"  # in a process standing for the runner (reads_runner_proc)
FORGED_MARKER = "forged-by-"  # in every fake trace line and daemon write
DAEMON_MARKER = b"flashbench-attack-daemon"  # in the command line of daemon_double_fork's and gpu_daemon's daemons
SLEEPING_CHILD = [sys.executable, "-c", "import time; time.sleep(600)"]  # what spawns_child starts
LITTER_PREFIX = "flashbench-attack-"  # huge_sparse_files' files
LITTER_PLACES = [Path("/tmp"), Path("/dev/shm")]

# Entries that need options of their own share a Runner; the other run entries go to "outputs".
LATER = ["cache_by_pointer", "cache_by_structure", "precomputes_outputs", "counts_calls", "inspects_stack"]
PROCESS = ["crash_segfault", "exit_at_import", "sys_exit_at_import", "sys_exit_at_call", "raises", "raises_unprintable",
           "bad_entry", "missing_dep", "link_outside", "huge_allocation", "spawns_child", "daemon_double_fork",
           "huge_sparse_files", "hang", "stops_reading_requests", "hides_in_pid_namespace", "zombie_leader_child"]
FILES = [name for name, record in RECORDS.items() if "process_level" in record] + ["writes_reference_cache"]
BASE = {"device": "cpu", "iters": 3, "warmup": 0, "input_sets": 2, "timeout": 60.0}
OPTIONS = {
    "outputs": {},
    # A public run seed the fixtures guessed: the input sets match their table, no timed call does.
    "later": {"seed": 0},
    # An address-space limit makes huge_allocation fail fast; a short timeout bounds hang and
    # stops_reading_requests, which wait it out on each workload (the other requests take well under 1 s).
    "process": {"timeout": 5.0, "memory_limit_bytes": 8 << 30},
    "files": {},
    "unsandboxed": {"isolation": "process"},
    "cuda": {"device": "cuda", "timeout": 120.0, "iters": 10, "warmup": 2},
}
# The groups each module runs, so that pytest-xdist's two processes share the corpus. Only "process" starts
# processes and litters the host, so only its module looks for them: a look from the other module could find,
# and kill, those of a job still running in this one.
PARTS = {"test_adversarial": ("process", "files", "unsandboxed", "cuda"),
         "test_adversarial_outputs": ("outputs", "later")}


def acceptable(expectation: dict) -> list[str]:
    expected = expectation["expected"]
    return expected if isinstance(expected, list) else [expected]


def selected_at_run(record: dict) -> bool:
    return SELECTION_ERROR not in acceptable(record)


def default_level() -> str:
    from flashbench.run import sandbox

    return sandbox.available_isolation()


def groups(part: str | None = None) -> dict[str, list[str]]:
    """Entry names by group, the control last in each; cuda entries only where a GPU is present. With `part`,
    the groups of that module (PARTS)."""
    level = default_level()
    cpu = [name for name, record in RECORDS.items()
           if record["device"] == "cpu" and name != CONTROL and selected_at_run(record)
           and expectation_for(record, level) is not None]
    chosen = {
        "outputs": [name for name in cpu if name not in LATER + PROCESS + FILES],
        "later": [name for name in cpu if name in LATER],
        "process": [name for name in cpu if name in PROCESS],
        "files": [name for name in cpu if name in FILES],
    }
    if level == "namespaces":  # the same attacks without the sandbox: they must get through
        chosen["unsandboxed"] = [name for name in chosen["files"] if "process_level" in RECORDS[name]]
    if ON_GPU:
        chosen["cuda"] = [name for name, record in RECORDS.items() if record["device"] == "cuda"]
    return {group: names + [CONTROL] for group, names in chosen.items() if part is None or group in PARTS[part]}


def part_of(node) -> str:
    """The module (its PARTS key) of a test, a fixture's request or a metafunc."""
    return Path(node.module.__file__).stem


def pytest_generate_tests(metafunc):
    """test_verdict's entries: those its module runs, and in the main module also those run nowhere."""
    if "entry" in metafunc.fixturenames:
        part = part_of(metafunc)
        here = {name for names in groups(part).values() for name in names}
        run = {name for names in groups().values() for name in names}
        metafunc.parametrize("entry", [name for name in RECORDS
                                       if name in here or (part == "test_adversarial" and name not in run)])


@dataclass
class Outcome:
    traces: dict = field(default_factory=dict)  # (name, workload) -> traces, one per group it ran in
    order: dict = field(default_factory=dict)  # group -> solution names in the order they ran
    results: dict = field(default_factory=dict)  # group -> RunResult
    trace_dirs: dict = field(default_factory=dict)  # group -> its trace directory
    evidence: Path | None = None  # what pickle_reply's pickle would create in the runner
    cache: Path | None = None
    daemons: list = field(default_factory=list)  # pids of fixtures' processes found after the run (then killed)
    litter: list = field(default_factory=list)  # huge_sparse_files' files found on the host after the run


def write_targets(copy: Path, names: list[str], targets: dict) -> None:
    for name in names:
        if name != CONTROL:
            (copy / name / "targets.json").write_text(json.dumps(targets, indent=1))


def checkout_files() -> list[str]:
    """Files of the checkout flashbench runs from outside its package: its git history holds every
    committed solution and trace."""
    root = Path(sandbox.SOURCE_ROOT)
    return [str(path) for path in (root / "pyproject.toml", root / ".git" / "HEAD") if path.is_file()]


def run_group(runner: Runner, copy: Path, names: list[str]):
    repo = runner.repo
    folders = select_solutions(repo, DEFINITION, [str(copy / name) for name in names])
    workloads = select_workloads(repo, DEFINITION, SMOKE, runner.options.device)
    return runner.run(runner.candidates(folders)[1:], workloads)  # [0] is the reference


def processes_with(marker: bytes, whole: bool = False) -> list[int]:
    """Processes whose command line holds `marker` (is `marker`, with `whole`)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = cmdline.read_bytes()
            if (line == marker if whole else marker in line) and int(cmdline.parent.name) != os.getpid():
                found.append(int(cmdline.parent.name))
        except (OSError, ValueError):
            continue
    return found


def litter() -> set[Path]:
    return {path for place in LITTER_PLACES for path in place.glob(f"{LITTER_PREFIX}*")}


def remove(paths) -> None:
    for path in paths:
        try:
            path.unlink()
        except OSError:
            pass


@pytest.fixture(scope="module")
def adversarial_run(request) -> Outcome:
    """Every group once, two at a time; then what is left behind is collected (and cleaned up)."""
    # All of it outside /tmp: a sandboxed worker sees a fresh /tmp, so paths there (trace files to
    # attack, the fixtures' shared helpers beside their folders) would not be the host's.
    tmp = Path(tempfile.mkdtemp(prefix="flashbench-adversarial-", dir="/var/tmp"))
    tmp.chmod(0o755)  # a root runner's workers run as a uid of their own where it can reach the cache in here
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    outcome = Outcome(evidence=tmp / "evidence" / "pickle-ran", cache=tmp / "cache")
    outcome.evidence.parent.mkdir()
    repo_root = copy_repo(tmp / "repo")
    repo = Repo(repo_root)
    planted = repo_root / "solutions" / DEFINITION / "another_solution" / "kernel.py"  # what reads_hidden_files
    planted.parent.mkdir(parents=True)  # looks for (without a manifest, no solution the repository lists)
    planted.write_text("# another solution's code\n")
    chosen = groups(part_of(request))
    sweeps = "process" in chosen  # PARTS says why
    copies, runners = {}, {}
    for group in chosen:  # "unsandboxed" runs the entries of "files": a copy of its own, aimed at its own files
        copies[group] = tmp / ("unsandboxed-solutions" if group == "unsandboxed" else "solutions") / DEFINITION
        if not copies[group].exists():  # the fixtures' folders, and beside them the shared folder they name
            shutil.copytree(SOLUTIONS, copies[group], symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
            shutil.copytree(SOLUTIONS.parent / "_shared", copies[group].parent / "_shared")
    edit_files = [str(repo_root / repo.definition(DEFINITION).reference), str(repo.definition_path(DEFINITION)),
                  str(tmp / "solutions" / DEFINITION / CONTROL / "kernel.py")]
    for group, names in chosen.items():
        trace_dir = tmp / group / "traces"
        runners[group] = Runner(repo, DEFINITION, RunOptions(**{**BASE, **OPTIONS[group], "trace_dir": trace_dir,
                                                                 "cache_dir": outcome.cache}))
        outcome.trace_dirs[group] = trace_dir
        write_targets(copies[group], names, {
            "trace_file": str(runners[group].trace_file), "trace_dir": str(trace_dir),
            "evidence_file": str(outcome.evidence), "reference_cache": str(tmp / group / "reference-cache"),
            "edit_files": edit_files, "solutions_dir": str(copies[group]),
            "repo_solutions": str(repo_root / "solutions"), "cache_dir": str(outcome.cache),
            "other_solution": str(copies[group] / CONTROL), "checkout_files": checkout_files(),
            "definition": repo.definition_path(DEFINITION).read_text(),
            "workloads": repo.workloads_path(DEFINITION).read_text(),
        })

    secret = secrets.token_hex(8)
    if sweeps:
        remove(litter())  # from an earlier, interrupted session
    stand_in = subprocess.Popen(  # the runner, as far as /proc tells: the secret in its environment and command line
        [*SLEEPING_CHILD, f"{SECRET_VARIABLE}={secret}"],
        env={**os.environ, SECRET_VARIABLE: secret}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(SECRET_VARIABLE, secret)  # reaches a worker only if its environment is not an allow-list

            def run(group: str):
                return group, run_group(runners[group], copies[group], chosen[group])

            with ThreadPoolExecutor(max_workers=1) as pool:  # one group at a time: the suite runs beside it
                results = list(pool.map(run, list(chosen)))
    finally:
        stand_in.kill()
        stand_in.wait()
        if sweeps:
            sleeping_child = "\0".join(SLEEPING_CHILD).encode() + b"\0"
            outcome.daemons = processes_with(DAEMON_MARKER) + processes_with(sleeping_child, whole=True)
            for pid in outcome.daemons:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            outcome.litter = sorted(litter())
            remove(outcome.litter)
    for group, result in results:
        outcome.results[group] = result
        for trace in result.traces:
            outcome.traces.setdefault((trace.solution, trace.workload_name), []).append(trace)
        outcome.order[group] = list(dict.fromkeys(trace.solution for trace in result.traces))
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
    assert set(record) <= {"name", "expected", "message", "device", "isolation", "process_level",
                           "confined_process_level", "min_latency_ms", "min_control_share", "attack"}
    assert set(acceptable(record)) <= STATUSES | {SELECTION_ERROR}
    assert record["device"] in ("cpu", "cuda")
    assert record.get("isolation", "namespaces") == "namespaces"
    if "confined_process_level" in record:
        assert "process_level" in record, "a verdict where writes are confined refines one at level process"
    for key in ("process_level", "confined_process_level"):
        if key in record:
            assert "isolation" in record, "a verdict at level process is only given for entries that need namespaces"
            assert set(record[key]) <= {"expected", "message"}
            assert set(acceptable(record[key])) <= STATUSES
    assert record["attack"].strip()


# Verdicts.

def expectation_for(record: dict, level: str) -> dict | None:
    """What the entry must get at isolation `level`; None where nothing is promised."""
    if record.get("isolation") == "namespaces" and level != "namespaces":
        if sandbox.confines_writes() and "confined_process_level" in record:
            return record["confined_process_level"]
        return record.get("process_level")
    return record


def test_every_group_runs_in_a_module():
    assert set(groups()) <= {group for part in PARTS.values() for group in part}


def test_verdict(adversarial_run, entry):
    record = RECORDS[entry]
    if record["device"] == "cuda" and not ON_GPU:
        pytest.skip("needs a GPU")
    if not selected_at_run(record):
        with pytest.raises(FlashbenchError) as refused:
            select_solutions(Repo(FIXTURES.parents[1]), DEFINITION, [str(SOLUTIONS / entry)])
        assert record["message"] in str(refused.value) and "\n" not in str(refused.value)
        return
    if expectation_for(record, default_level()) is None:
        pytest.skip(f"not run at level {default_level()}")
    checked = 0
    for workload in SMOKE:
        traces = adversarial_run.traces.get((entry, workload))
        assert traces, f"{entry} did not run on {workload}"
        for trace in traces:
            expectation = expectation_for(record, trace.isolation)
            if expectation is None:
                continue
            checked += 1
            described = f"{entry} on {workload} at level {trace.isolation}: {trace.status} {trace.message!r}"
            assert trace.status in acceptable(expectation), described
            if "message" in expectation and trace.status != "PASSED":
                assert expectation["message"] in trace.message, described
            if trace.status == "PASSED":
                assert trace.performance is not None and trace.performance.latency_ms > 0, described
                assert trace.performance.latency_ms >= expectation.get("min_latency_ms", 0), described
                if "min_control_share" in expectation:  # a pass with no gain: at about the correct solution's time
                    control = min(t.performance.latency_ms for t in adversarial_run.traces[(CONTROL, workload)])
                    assert trace.performance.latency_ms >= expectation["min_control_share"] * control, described
            else:
                assert trace.performance is None and trace.message, described
    if not checked:
        pytest.skip(f"nothing is promised at level {default_level()}")


def test_the_control_runs_last_in_every_group(adversarial_run, request):
    for group, names in groups(part_of(request)).items():
        assert adversarial_run.order[group] == names, group
    assert len(adversarial_run.traces[(CONTROL, SMOKE[0])]) == len(groups(part_of(request)))


def test_every_trace_records_its_isolation_level(adversarial_run):
    for group, result in adversarial_run.results.items():
        assert result.isolation in LEVELS, group
        assert result.isolation == ("process" if group == "unsandboxed" else default_level()), group
        assert {trace.isolation for trace in result.traces} == {result.isolation}, group


# How the runner records the failures, and the run going on after them.

def test_every_pair_is_recorded_in_order(adversarial_run, request):
    """Each group's pairs in the order given, every workload of an entry before the next entry; the
    trace file holds the same statuses in the same order."""
    for group, names in groups(part_of(request)).items():
        result = adversarial_run.results[group]
        assert [(t.solution, t.workload_name) for t in result.traces] == [(n, w) for n in names for w in SMOKE], group
        lines = [json.loads(line) for line in result.trace_file.read_text().splitlines()]
        assert [line["status"] for line in lines] == [t.status for t in result.traces], group
        assert {line["isolation"] for line in lines} == {result.isolation}, group
        assert result.skipped == [], group


def only_trace(adversarial_run, name: str, workload: str):
    """The trace of an entry that runs in one group only."""
    (trace,) = adversarial_run.traces[(name, workload)]
    return trace


def test_a_crash_at_import_is_named_as_one_of_the_build(adversarial_run):
    for workload in SMOKE:  # the second workload's worker was a fresh one, and crashed on its own
        assert only_trace(adversarial_run, "exit_at_import", workload).message == "build: the worker exited with code 3"


def test_failure_messages_say_what_went_wrong(adversarial_run):
    pick = lambda name: only_trace(adversarial_run, name, "smoke_mixed")  # noqa: E731
    assert "Traceback" in pick("raises").log
    assert pick("missing_dep").message == "not installed: package_that_does_not_exist_xyz"


def test_the_control_after_the_failures_passes_and_is_timed(adversarial_run):
    for group, result in adversarial_run.results.items():
        options = {**BASE, **OPTIONS[group]}
        if options["device"] != "cpu":
            continue
        controls = [trace for trace in result.traces if trace.solution == CONTROL]
        assert [trace.workload_name for trace in controls] == SMOKE, group
        for trace in controls:
            timing = trace.performance.timing
            assert trace.status == "PASSED" and trace.performance.latency_ms > 0, group
            assert timing["batches"] * timing["calls_per_batch"] >= options["iters"], group
            assert (timing["method"], timing["warmup"], timing["iters"]) == ("host clock", 0, options["iters"]), group
            assert timing["seeds"] == ("secret" if options.get("seed") is None else "public"), group
            assert timing["l2_flush_bytes"] == 0, group  # no L2 flush on a CPU
            assert trace.performance.reference_latency_ms is None, group  # the reference was not part of the run
            assert trace.performance.speedup is None, group
            assert trace.correctness["output"].mismatch_fraction == 0.0, group
            assert trace.log == "", group


# What the entries must not leave behind.

def test_the_trace_files_hold_only_what_the_runner_wrote(adversarial_run, capsys):
    for group, result in adversarial_run.results.items():
        capsys.readouterr()
        lines = read_traces(result.trace_file)
        assert capsys.readouterr().err == "", f"{group}: a line of the trace file is not a valid trace"
        assert len(lines) == len(result.traces), group
        assert FORGED_MARKER not in result.trace_file.read_text(), group


def test_foreign_files_in_the_trace_directory_are_set_aside(adversarial_run):
    """Inside the sandbox no entry can write the trace directory; without it writes_foreign_trace
    does, and the runner renames what it wrote out of the boards' way and reports it."""
    for group, result in adversarial_run.results.items():
        files = {path for path in adversarial_run.trace_dirs[group].rglob("*") if path.is_file()}
        foreign = {path for path in files if path != result.trace_file}
        assert all(path.name.endswith(UNTRUSTED_SUFFIX) for path in foreign), f"{group}: {sorted(foreign)}"
        assert set(result.untrusted_files) == foreign, group
        if result.isolation == "namespaces":
            assert result.untrusted_files == [], group
    if "unsandboxed" in adversarial_run.results:
        written = adversarial_run.results["unsandboxed"].untrusted_files
        if sandbox.confines_writes():
            assert written == [], "writes_foreign_trace wrote through Landlock at level process"
        else:
            assert written, "writes_foreign_trace wrote nothing unsandboxed"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_no_process_outlives_its_solution(adversarial_run):
    assert adversarial_run.traces[("spawns_child", SMOKE[0])]  # it did run
    assert adversarial_run.daemons == [], "processes the fixtures started were still running after the run (now killed)"


def test_no_worker_files_are_left(adversarial_run):
    workers = adversarial_run.cache / "workers"
    left = sorted(p.name for p in workers.iterdir()) if workers.exists() else []
    assert left == [], "exchange directories or logs of workers were left"


def test_files_written_in_the_sandbox_stay_there(adversarial_run):
    """huge_sparse_files litters /tmp and /dev/shm: at level namespaces both are its own."""
    assert adversarial_run.traces[("huge_sparse_files", SMOKE[0])]
    if default_level() != "namespaces":
        pytest.skip("at level process /tmp and /dev/shm are the host's (the test removed the files)")
    assert adversarial_run.litter == []
