"""The runner (flashbench/run/runner.py, jobs.py, session.py, supervisor.py, worker/): a hang times
out and the run goes on; only the files the content hash covers run; folders the judge will not
read; reference outputs past their memory budget; workload and solution selection; the timing
method of each candidate; resuming after the runner was killed, and a killed runner's workers
ending with it; a Triton solution under the interpreter. (tests/test_adversarial.py runs the
corpus of misbehaving solutions: every failure gets its own status, ends at most its own worker,
and the run goes on; tests/test_session.py has the judging of one job in detail.)"""

import importlib.util
import json
import os
import py_compile
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from conftest import copy_repo

from flashbench import FlashbenchError, Repo
from flashbench.build import CACHE_DIR_NAME, MAX_FILE_BYTES
from flashbench.cli import main
from flashbench.run import RunOptions, Runner, jobs, sandbox, select_solutions, select_workloads, supervisor
from flashbench.run.jobs import JobJudge, JudgeConfig
from flashbench.run.judge.clock import Baseline
from flashbench.run.options import GPU_CHECKED_CALLS
from flashbench.run.plan import Job

ROOT = Path(__file__).resolve().parents[1]
DEFINITION = "mla_paged_decode_h16_ckv512_kpe64_ps1"
FIXTURES = Path(__file__).parent / "fixtures" / "solutions" / DEFINITION
SMOKE = ["smoke_empty_short", "smoke_mixed"]


def run_solutions(repo_root, cache, tmp, paths, timeout=30.0, workloads=(), reference=False, on_phase=None, **options):
    """Run solution folders through the Python API; the reference candidate only when asked for."""
    repo = Repo(repo_root)
    run_options = RunOptions(device="cpu", iters=2, warmup=0, timeout=timeout, trace_dir=tmp / "traces",
                             cache_dir=cache, **options)
    runner = Runner(repo, DEFINITION, run_options)
    candidates = runner.candidates(select_solutions(repo, DEFINITION, [str(p) for p in paths]))
    return runner.run(candidates if reference else candidates[1:], select_workloads(repo, DEFINITION, list(workloads), "cpu"),
                      on_phase=on_phase or (lambda job, phase: None))


# The corpus of misbehaving solutions (tests/fixtures/adversarial.yaml) runs once, in
# tests/test_adversarial.py: there every entry's status and message on each smoke workload, the
# pairs recorded in order with the trace file agreeing, a crash named by its signal or exit code
# (at import: during the build), the worker restarted for the next workload, unwritten rows left
# poisoned, printed claims only logged, the correct solution after the failures passing and timed,
# and no worker file left.


def standalone_copy(fixture: str, folder: Path) -> Path:
    """A fixture copied where no solutions tree holds its shared folder: with that folder's files in it."""
    shutil.copytree(FIXTURES / fixture, folder)
    for shared in (FIXTURES.parent / "_shared" / "decode_support").iterdir():
        shutil.copy(shared, folder / shared.name)
    manifest = folder / "solution.yaml"
    manifest.write_text(manifest.read_text().replace("shared: [decode_support]\n", ""))
    return folder


def test_only_the_files_the_hash_covers_can_run(repo_copy, shared_cache, tmp_path):
    """Compiled bytecode beside the source, and code posing as documentation, are left out of the
    content hash: the worker's copy of the folder holds neither, so neither can run."""
    shadowed = standalone_copy("correct_dps", tmp_path / "shadowed")
    (tmp_path / "evil.py").write_text("def run(*args):\n    for out in args[-2:]:\n        out.zero_()\n")
    py_compile.compile(str(tmp_path / "evil.py"), cfile=importlib.util.cache_from_source(str(shadowed / "kernel.py")),
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    notes = standalone_copy("correct_dps", tmp_path / "notes")
    (notes / "solution.yaml").write_text((notes / "solution.yaml").read_text().replace("correct_dps", "notes"))
    (notes / "NOTES.md").write_text((notes / "kernel.py").read_text())
    (notes / "kernel.py").write_text("from pathlib import Path\nexec((Path(__file__).parent / 'NOTES.md').read_text())\n")
    result = run_solutions(repo_copy, shared_cache, tmp_path, [shadowed, notes], workloads=["smoke_mixed"])
    by_name = {t.solution: t for t in result.traces}
    assert by_name["correct_dps"].status == "PASSED"  # its source ran, not the bytecode beside it
    assert by_name["notes"].status == "INVALID_SOLUTION" and "FileNotFoundError" in by_name["notes"].message


def test_folders_the_judge_will_not_read_are_invalid_and_the_run_goes_on(repo_copy, shared_cache, tmp_path):
    """A red team's folders crashed or hung the runner while it staged them, with every other solution of
    the run: a 64 GiB sparse file (copied densely; here twice the limit), a fifo, a name that is not UTF-8, a
    link loop."""
    made = {}
    for name in ("sparse", "fifo", "bad_name", "loop"):
        made[name] = standalone_copy("correct_dps", tmp_path / name)
        manifest = made[name] / "solution.yaml"
        manifest.write_text(manifest.read_text().replace("name: correct_dps", f"name: {name}"))
    with open(made["sparse"] / "weights.bin", "wb") as file:
        file.truncate(2 * MAX_FILE_BYTES)
    os.mkfifo(made["fifo"] / "pipe")
    open(os.fsencode(made["bad_name"]) + b"/\xff.py", "wb").close()
    (made["loop"] / "loop").symlink_to("loop")
    paths = [*made.values(), FIXTURES / "correct_dps"]
    result = run_solutions(repo_copy, shared_cache, tmp_path, paths, workloads=["smoke_mixed"])
    assert [(t.solution, t.status) for t in result.traces] == [(name, "INVALID_SOLUTION") for name in made] + [
        ("correct_dps", "PASSED")]
    assert [t.message for t in result.traces[:4]] == [
        f"weights.bin is {2 * MAX_FILE_BYTES} bytes; a file may have 32 MiB", "pipe is not a regular file",
        "'\\udcff.py': a file name must be printable UTF-8",
        "loop is a link that leads nowhere (Too many levels of symbolic links)"]
    assert not list((shared_cache / "solutions").glob(".staging-*"))


def test_a_cuda_solution_without_its_toolchain_is_the_judges_missing_dependency(tmp_path, monkeypatch):
    """The judge checks nvcc itself: then a build failure a worker reports never has to be believed
    (run/resume.py runs only MISSING_DEPENDENCY again)."""
    from torch.utils import cpp_extension

    from flashbench.model import Solution
    from flashbench.run.plan import Candidate

    (tmp_path / "kernel.cu").write_text("// kernel\n")
    solution = Solution(name="k", definition=DEFINITION, author="a", language="cuda", entry_point="kernel.cu::run")
    monkeypatch.setattr(jobs.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    failure = jobs._failure_before_start(Candidate(tmp_path, solution, "h"))
    assert (failure.status, failure.message) == ("MISSING_DEPENDENCY",
                                                 "a CUDA solution needs nvcc (no CUDA toolkit found; set CUDA_HOME)")


@pytest.mark.parametrize("litter", [
    'open(os.path.join(os.environ["HOME"], "junk"), "wb").write(os.urandom(3 << 20))',  # 3 MiB in one file
    '[open(os.path.join(os.environ["HOME"], f"junk{i}"), "wb").close() for i in range(300)]',  # 300 empty files
])
def test_a_build_directory_left_over_its_limit_is_rejected_and_emptied(repo_copy, shared_cache, tmp_path, monkeypatch,
                                                                       litter):
    """A solution's build directory outlives its runs: one filled with junk (a red team filled the disk so, and
    every later run failed; another, its inodes) gets the pair REJECTED and is emptied when its worker ends."""
    for module in (jobs, supervisor):
        monkeypatch.setattr(module, "BUILD_DIR_LIMIT_BYTES", 1 << 20)
        monkeypatch.setattr(module, "BUILD_DIR_LIMIT_FILES", 100)
    filler = standalone_copy("correct_dps", tmp_path / "fills_build_dir")
    manifest = filler / "solution.yaml"
    manifest.write_text(manifest.read_text().replace("name: correct_dps", "name: fills_build_dir"))
    kernel = filler / "kernel.py"
    kernel.write_text(f'import os\nos.makedirs(os.environ["HOME"], exist_ok=True)\n{litter}\n' + kernel.read_text())
    result = run_solutions(repo_copy, shared_cache, tmp_path, [filler, FIXTURES / "correct_dps"],
                           workloads=["smoke_mixed"])
    filled, correct = result.traces
    assert filled.status == "REJECTED" and filled.message.startswith("its build directory holds ")
    assert "GiB or 100 files a solution may keep there between runs; it was emptied" in filled.message
    assert correct.status == "PASSED"
    assert not list((shared_cache / "build").rglob("junk*"))


def test_hang_times_out_and_the_run_goes_on(repo_copy, shared_cache, tmp_path):
    phases = []
    result = run_solutions(repo_copy, shared_cache, tmp_path, [FIXTURES / "hang", FIXTURES / "correct_dps"],
                           timeout=3, workloads=["smoke_mixed"],
                           on_phase=lambda job, phase: phases.append((job.candidate.solution.name, phase)))
    hang, correct = result.traces
    assert (hang.solution, hang.status) == ("hang", "TIMEOUT")
    assert hang.message == "no answer within the workload's 3 s (its timeout, for all its requests)"
    assert "hang: looping forever" in hang.log
    assert (correct.solution, correct.status) == ("correct_dps", "PASSED")
    # Progress displays learn which pair is in which phase; the hang never got past its first calls.
    assert phases == [("hang", "build"), ("hang", "reference"), ("hang", "check"),
                      ("correct_dps", "build"), ("correct_dps", "reference"), ("correct_dps", "check"),
                      ("correct_dps", "time")]


def test_reference_outputs_past_the_memory_budget_are_dropped_and_computed_again(repo_copy, shared_cache, tmp_path,
                                                                                 monkeypatch):
    stores = []

    class Store(jobs.ReferenceStore):  # the run's store, kept for a look afterwards
        def __init__(self, *args):
            super().__init__(*args)
            stores.append(self)

    monkeypatch.setattr(jobs, "ReferenceStore", Store)
    repo = Repo(repo_copy)
    options = RunOptions(device="cpu", iters=2, warmup=0, trace_dir=tmp_path / "traces", cache_dir=shared_cache,
                         reference_memory_bytes=0, seed=5)
    runner = Runner(repo, DEFINITION, options)
    workloads = select_workloads(repo, DEFINITION, SMOKE, "cpu")
    result = runner.run(runner.candidates(select_solutions(repo, DEFINITION, [str(FIXTURES / "correct_dps")])), workloads)
    assert [(t.solution, t.status) for t in result.traces] == [("reference", "PASSED")] * 2 + [("correct_dps", "PASSED")] * 2
    assert all(t.performance.reference_latency_ms > 0 for t in result.traces)
    assert all(t.performance.timing["seeds"] == "public" for t in result.traces)  # the run's seed was given
    # Only the last job's reference outputs are still held: those of one input set, just computed.
    (store,) = stores
    assert [uuid for uuid, _ in store._kept] == [workloads[-1].uuid]


def test_the_run_seed_makes_the_input_sets_public_and_repeatable(repo_copy):
    """With a seed the input sets are the same on every run (each timed call still draws a secret
    seed of its own); without one they are drawn afresh, and the traces say which."""
    repo = Repo(repo_copy)
    public = JudgeConfig.for_run(repo.definition(DEFINITION), repo.root, repo.definition_path(DEFINITION),
                                 RunOptions(seed=5, input_sets=3, isolation="process"), "")
    assert public.set_seeds == [5, 6, 7]
    secret = [JudgeConfig.for_run(repo.definition(DEFINITION), repo.root, repo.definition_path(DEFINITION),
                                  RunOptions(input_sets=3, isolation="process"), "").set_seeds for _ in range(2)]
    assert secret[0] != secret[1] and len(set(secret[0])) == 3


# Workload and solution selection (no workers).

@pytest.fixture(scope="module")
def repo(repo_copy):
    return Repo(repo_copy)


def names(workloads):
    return [w.name for w in workloads]


def test_a_cpu_run_with_no_smoke_workload_is_refused_with_one_line(tmp_path):
    root = copy_repo(tmp_path / "repo")
    workloads = root / "definitions" / "mla_paged" / f"{DEFINITION}.workloads.yaml"
    workloads.write_text(workloads.read_text().replace("smoke", "tiny"))
    with pytest.raises(FlashbenchError) as refused:
        select_workloads(Repo(root), DEFINITION, [], "cpu")
    assert "no workload of" in str(refused.value) and "--workload" in str(refused.value)
    assert select_workloads(Repo(root), DEFINITION, ["tiny"], "cpu")  # named, they run


def test_a_workload_validate_refuses_is_refused_before_any_pair_runs(tmp_path):
    """Its pairs failed every solution, the reference's too, and reached the boards as failures."""
    root = copy_repo(tmp_path / "repo")
    workloads = root / "definitions" / "mla_paged" / f"{DEFINITION}.workloads.yaml"
    data = yaml.safe_load(workloads.read_text())
    data["workloads"][1]["generate"][0]["page_pool"] = 3
    workloads.write_text(yaml.safe_dump(data, sort_keys=False))
    runner = Runner(Repo(root), DEFINITION, RunOptions(trace_dir=tmp_path / "traces", cache_dir=tmp_path / "cache"))
    chosen = select_workloads(Repo(root), DEFINITION, [], "cpu")  # listed: the set's other workloads can be seen
    with pytest.raises(FlashbenchError) as refused:
        runner.run(runner.candidates([]), chosen)
    assert refused.value.file == str(workloads) and refused.value.field == "workload smoke_mixed"
    assert "page_pool 3 is smaller" in refused.value.message and not (tmp_path / "traces").exists()


def test_cpu_default_is_smoke_only(repo):
    assert names(select_workloads(repo, DEFINITION, [], "cpu")) == SMOKE
    everything = select_workloads(repo, DEFINITION, [], "cuda")
    assert len(everything) > 2 and names(everything)[:2] == SMOKE


def test_select_by_name_tag_and_uuid_prefix(repo):
    assert names(select_workloads(repo, DEFINITION, ["b1_l1024"], "cpu")) == ["b1_l1024"]
    assert names(select_workloads(repo, DEFINITION, ["smoke"], "cuda")) == SMOKE
    assert names(select_workloads(repo, DEFINITION, ["bandwidth"], "cpu")) == ["b64_l4096"]
    assert names(select_workloads(repo, DEFINITION, ["810323f4"], "cpu")) == ["smoke_mixed"]
    assert names(select_workloads(repo, DEFINITION, ["810323f4-6465-4c15-a87f-4d0946faba69"], "cpu")) == ["smoke_mixed"]


def test_selectors_keep_order_without_duplicates(repo):
    chosen = select_workloads(repo, DEFINITION, ["smoke_mixed", "smoke", "926d5146"], "cpu")
    assert names(chosen) == ["smoke_mixed", "smoke_empty_short"]


def test_unknown_workload_lists_names_and_tags(repo):
    with pytest.raises(FlashbenchError, match="no workload matches 'nonexistent'") as info:
        select_workloads(repo, DEFINITION, ["nonexistent"], "cpu")
    for known in ("smoke_mixed", "b1_l1024", "smoke", "bandwidth"):
        assert known in str(info.value)


def test_reference_selects_no_solution_folder(repo):
    assert select_solutions(repo, DEFINITION, ["reference"]) == []
    named = select_solutions(repo, DEFINITION, ["reference", str(FIXTURES / "correct_dps")])
    assert [f.solution.name for f in named] == ["correct_dps"]


def test_unknown_solution_and_wrong_definition(repo):
    with pytest.raises(FlashbenchError, match="no solution 'nope'"):
        select_solutions(repo, DEFINITION, ["nope"])
    with pytest.raises(FlashbenchError, match="not 'mla_paged_prefill"):
        select_solutions(repo, "mla_paged_prefill_causal_h16_ckv512_kpe64_ps1", [str(FIXTURES / "correct_dps")])


def judge_for(repo, tmp_path, **options) -> JobJudge:
    """A run's judge, as the runner builds it (no worker is started)."""
    run_options = RunOptions(trace_dir=tmp_path, cache_dir=tmp_path / "cache", isolation="process", **options)
    return JobJudge(JudgeConfig.for_run(repo.definition(DEFINITION), repo.root, repo.definition_path(DEFINITION),
                                        run_options, ""))


def test_graph_runs_time_the_reference_with_events(repo, tmp_path):
    """The reference copies index data to the host, which a CUDA graph cannot capture: under
    --timing graph it is timed with events, and only the solutions are replayed in graphs."""
    judge = judge_for(repo, tmp_path, device="cuda", timing="graph")  # a GPU run's options, without the GPU
    runner = Runner(repo, DEFINITION, RunOptions(trace_dir=tmp_path, cache_dir=tmp_path / "cache"))
    reference, solution = runner.candidates(select_solutions(repo, DEFINITION, [str(FIXTURES / "correct_dps")]))
    assert [judge.timing_method(c) for c in (reference, solution)] == ["events", "graph"]
    assert [judge.settings(c, "cuda").graph for c in (reference, solution)] == [False, True]
    cpu = judge_for(repo, tmp_path, device="cpu")
    assert cpu.timing_method(solution) == "events" and not cpu.settings(solution, "cpu").graph


def test_how_many_timed_calls_are_checked(repo, tmp_path):
    """All of them on a CPU, where the reference is cheap; a few on a GPU; or as many as asked for."""
    runner = Runner(repo, DEFINITION, RunOptions(trace_dir=tmp_path, cache_dir=tmp_path / "cache"))
    (reference,) = runner.candidates([])
    assert judge_for(repo, tmp_path).settings(reference, "cpu").checked_calls is None
    assert judge_for(repo, tmp_path, device="cuda").settings(reference, "cuda").checked_calls == GPU_CHECKED_CALLS
    assert judge_for(repo, tmp_path, checked_calls=3).settings(reference, "cpu").checked_calls == 3
    assert judge_for(repo, tmp_path, device="cuda", checked_calls=0).settings(reference, "cuda").checked_calls == 0


def test_a_job_of_a_solution_lacks_clean_steps_until_they_are_measured(repo, tmp_path):
    """The cap on the steps the judge takes away comes from the reference's jobs; where they did not
    run first (a resumed run, a Ray task), the judge measures the steps alone before the job."""
    runner = Runner(repo, DEFINITION, RunOptions(trace_dir=tmp_path, cache_dir=tmp_path / "cache"))
    reference, solution = runner.candidates(select_solutions(repo, DEFINITION, [str(FIXTURES / "correct_dps")]))
    (workload,) = select_workloads(repo, DEFINITION, ["smoke_mixed"], "cpu")
    judge = judge_for(repo, tmp_path, device="cuda")  # a GPU run's options, without the GPU
    assert judge.lacks_clean_steps(Job(0, solution, workload), "cuda:0")
    assert not judge.lacks_clean_steps(Job(1, reference, workload), "cuda:0")  # it measures them itself
    assert judge.lacks_clean_steps(Job(2, solution, workload), "cpu")  # a CPU's steps are capped too
    judge.clean_steps._costs[(workload.uuid, "cuda:0")] = 0.2
    assert not judge.lacks_clean_steps(Job(3, solution, workload), "cuda:0")


@pytest.mark.parametrize("free_gb, reserved_gb, held", [(100, 1, False), (30, 1, True), (60, 30, False)])
def test_a_device_is_held_by_others_when_over_half_of_it_is_outside_the_judge(repo, tmp_path, monkeypatch,
                                                                               free_gb, reserved_gb, held):
    """Total 140 GB: what is neither free nor the judge's own is the idle worker's (and any other process's)."""
    gb = 1 << 30
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free_gb * gb, 140 * gb))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: reserved_gb * gb)
    judge = judge_for(repo, tmp_path, device="cuda")
    assert judge.device_held_by_others("cuda:0") is held
    assert judge.device_held_by_others("cpu") is False


def test_clean_steps_measured_alone_are_the_steps_per_call(repo, tmp_path, monkeypatch):
    """The same steps as in the reference's jobs, which measure the cap in a run that is not resumed: the
    reference returns its outputs, so the copy into the slot is one of them (else a resumed run would charge
    a solution that returns its outputs its copy, and a fresh run would not)."""
    made = []

    def recorded(*args, **kwargs):
        made.append(kwargs["copies_outputs"])
        return Baseline(*args, **kwargs)

    monkeypatch.setattr(jobs, "Baseline", recorded)
    (workload,) = select_workloads(repo, DEFINITION, ["smoke_mixed"], "cpu")
    judge = judge_for(repo, tmp_path)
    judge.measure_clean_steps(workload, "cpu")
    assert judge.clean_steps.get(workload.uuid, "cpu") > 0
    assert made == [True]


def test_graph_timing_and_unknown_backends_are_refused_before_any_work(repo, tmp_path):
    with pytest.raises(FlashbenchError, match="--timing graph replays CUDA graphs: it needs a CUDA device"):
        Runner(repo, DEFINITION, RunOptions(device="cpu", timing="graph", trace_dir=tmp_path))
    with pytest.raises(FlashbenchError, match="no backend 'slurm'; known: local, ray"):
        Runner(repo, DEFINITION, RunOptions(backend="slurm", trace_dir=tmp_path))


def test_the_reference_is_a_candidate_of_its_own_keyed_by_its_source(repo, tmp_path):
    runner = Runner(repo, DEFINITION, RunOptions(trace_dir=tmp_path, cache_dir=tmp_path / "cache"))
    reference, solution = runner.candidates(select_solutions(repo, DEFINITION, [str(FIXTURES / "correct_dps")]))
    assert reference.solution.name == "reference" and not reference.solution.destination_passing_style
    assert (reference.folder / "reference.py").is_file() and reference.folder.is_relative_to(tmp_path / "cache")
    assert runner.candidates([])[0].hash == reference.hash and solution.solution.name == "correct_dps"



def test_a_worker_is_hidden_the_repository_every_candidates_sources_the_traces_the_cache_and_the_home(
        repo, tmp_path, monkeypatch):
    """What the judge gives the sandbox to hide: the repository and the checkout flashbench runs from (their
    git history holds every committed solution), and the folders every candidate was staged from, so that
    its staged copy is the only one of a solution a worker sees (tests/test_sandbox.py shows hidden folders
    empty; reads_hidden_files in tests/test_adversarial.py tries them through a run). What is shown of
    them: the FP8 quantize reference's folder, which workers' redraws load. A home that is the root is not
    hidden."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    runner = Runner(repo, DEFINITION, RunOptions(trace_dir=tmp_path, cache_dir=tmp_path / "cache"))
    chosen = runner.candidates(select_solutions(repo, DEFINITION, [str(FIXTURES / "correct_dps"),
                                                                   str(FIXTURES / "raises")]))
    reference, solution, other = chosen
    options = RunOptions(trace_dir=tmp_path, cache_dir=tmp_path / "cache", isolation="process")
    config = JudgeConfig.for_run(repo.definition(DEFINITION), repo.root, repo.definition_path(DEFINITION), options,
                                 "", tuple(path for candidate in chosen for path in candidate.sources))
    trees = (repo.root, Path(sandbox.SOURCE_ROOT), repo.root / "solutions", repo.root / ".git")
    shared, fixed = FIXTURES.parent / "_shared" / "decode_support", (tmp_path, tmp_path / "cache", tmp_path / "home")
    assert config.hidden_from(solution) == (*trees, FIXTURES / "correct_dps", shared, FIXTURES / "raises", *fixed)
    assert config.hidden_from(other) == (*trees, FIXTURES / "raises", FIXTURES / "correct_dps", shared, *fixed)
    assert config.hidden_from(reference) == (*trees, FIXTURES / "correct_dps", shared, FIXTURES / "raises", *fixed)
    shown = (tree / "references" / "flashmla_sparse" for tree in trees[:2])
    assert config.shown() == tuple(folder for folder in shown if folder.is_dir()) and config.shown()
    monkeypatch.setenv("HOME", "/")
    assert config.hidden_from(reference)[-2:] == fixed[:2]

# Resume after the runner was killed outright.

def cli_command(repo_root, trace_dir, *arguments):
    return [sys.executable, "-m", "flashbench", "--root", str(repo_root), "run", "--def", "mla_paged_decode",
            "--device", "cpu", "--trace-dir", str(trace_dir), "--iters", "2", "--warmup", "0", *arguments]


def trace_lines(trace_dir: Path) -> list[bytes]:
    files = list(trace_dir.glob(f"*/{DEFINITION}.jsonl"))
    return files[0].read_bytes().splitlines() if files else []


def wait_for(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}")


def workers_of(repo_root: Path) -> list[int]:
    """Running processes of the workers a CLI run in `repo_root` started (their command lines name
    their exchange directories, under the repository's cache); zombies do not count."""
    marker = str(repo_root / CACHE_DIR_NAME / "workers").encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if marker in (entry / "cmdline").read_bytes() and state not in ("Z", "X"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.fixture
def killed_run(fresh_repo):
    """Starts a CLI run in a session of its own; whatever the test leaves running is ended."""
    started = []

    def start(command, **kwargs):
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True, **kwargs)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
    for pid in workers_of(fresh_repo):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_resume_after_kill(tmp_path, fresh_repo, killed_run):
    repo_root = fresh_repo
    trace_dir = tmp_path / "traces"
    correct, hang = FIXTURES / "correct_dps", FIXTURES / "hang"
    runner = killed_run(cli_command(repo_root, trace_dir, "--solution", str(correct), "--solution", str(hang),
                                    "--timeout", "120"))
    wait_for(lambda: len(trace_lines(trace_dir)) >= 1, 120, "the first trace")
    os.kill(runner.pid, signal.SIGKILL)
    runner.wait(timeout=10)

    before = trace_lines(trace_dir)
    records = [json.loads(line) for line in before]  # every line is whole, valid JSON
    recorded = {(r["solution"], r["workload_name"]) for r in records}
    assert len(recorded) == len(records) >= 1
    assert all(r["solution"] in ("reference", "correct_dps") for r in records)
    wait_for(lambda: not workers_of(repo_root), 20, "the killed run's workers to end")

    result = CliRunner().invoke(main, cli_command(repo_root, trace_dir, "--solution", str(correct), "--resume",
                                                  "--timeout", "60")[3:])
    assert result.exit_code == 0, result.output
    assert f"{len(records)} pair(s) already recorded were skipped (--resume)" in result.output

    after = trace_lines(trace_dir)
    assert after[:len(before)] == before  # old lines untouched
    added = [json.loads(line) for line in after[len(before):]]
    expected = {(s, w) for s in ("reference", "correct_dps") for w in SMOKE}
    assert {(r["solution"], r["workload_name"]) for r in added} == expected - recorded  # the rest, once each
    assert len(added) == len(expected - recorded)
    assert all(r["status"] == "PASSED" for r in records + added)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="relies on the parent-death signal")
def test_killed_runner_takes_a_hanging_worker_with_it(tmp_path, fresh_repo, killed_run):
    repo_root = fresh_repo
    files = repo_root / CACHE_DIR_NAME / "workers"  # each worker's exchange directory and log (its output)
    runner = killed_run(cli_command(repo_root, tmp_path / "traces", "--solution", str(FIXTURES / "hang"),
                                    "--workload", "smoke_mixed", "--timeout", "120"))

    def hanging():
        for log in files.glob("*.log"):
            try:
                if b"looping forever" in log.read_bytes():
                    return True
            except FileNotFoundError:  # the log of a worker that ended meanwhile (the reference's)
                continue
        return False

    wait_for(hanging, 120, "the solution to start looping")
    assert workers_of(repo_root)  # the looping worker (and at level namespaces, the unshare holding it)
    os.kill(runner.pid, signal.SIGKILL)
    runner.wait(timeout=10)
    wait_for(lambda: not workers_of(repo_root), 20, "the orphaned worker to end")


# A Triton kernel under Triton's interpreter.

TRITON_SOLUTION = ROOT / "solutions" / DEFINITION / "triton_splitkv"


@pytest.mark.skipif(not (TRITON_SOLUTION / "solution.yaml").is_file(), reason="no Triton solution in the repository")
def test_triton_solution_under_the_interpreter(repo_copy, shared_cache, tmp_path):
    pytest.importorskip("triton")
    # One workload and input set: each interpreted call takes about a second. Its results on the cases of both
    # smoke workloads (empty requests, kv_len 1) are checked in tests/solutions/test_mla_decode_solutions.py.
    result = run_solutions(repo_copy, shared_cache, tmp_path, [TRITON_SOLUTION], timeout=120, workloads=SMOKE[1:],
                           input_sets=1)
    assert [(t.workload_name, t.status) for t in result.traces] == [(w, "PASSED") for w in SMOKE[1:]], \
        [t.message for t in result.traces]
    assert all(t.performance.timing["method"] == "host clock" for t in result.traces)
