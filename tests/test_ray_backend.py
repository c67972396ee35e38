"""The Ray backend (flashbench/run/ray_backend.py) on a local Ray instance: the same statuses as a
local run, one trace line per pair, and a one-line error where Ray is not installed. A task
itself (`job_task`, judge-side code run in the task's process) is also run directly, and the
driver's rules (a job whose device fails is submitted again, once; a malformed or failed task is
a device failure; a task on other hardware ends the run) are checked on a fake Ray."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from flashbench import FlashbenchError, Repo
from flashbench.cli import main
from flashbench.run import RunOptions, Runner, select_solutions, select_workloads
from flashbench.run import ray_backend
from flashbench.run.jobs import JobJudge, JudgeConfig
from flashbench.run.plan import Job
from flashbench.run.resume import TASK_DIED_KEY
from flashbench.run.ray_backend import TRIES, RayBackend, TaskAnswer, job_task
from flashbench.run.session import JobOutcome

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
    workers = shared_cache / "workers"
    result.worker_files_left = sorted(p.name for p in workers.iterdir()) if workers.exists() else []
    return result


def test_the_same_statuses_as_a_local_run(ray_run, repo_copy, shared_cache, tmp_path):
    local = run_with(repo_copy, shared_cache, tmp_path, "local")
    recorded = {(t.solution, t.workload_name, t.status) for t in ray_run.traces}
    assert recorded == {(t.solution, t.workload_name, t.status) for t in local.traces}
    statuses = {(solution, status) for solution, _, status in recorded}
    assert statuses == {("reference", "PASSED"), ("torch_vectorized", "PASSED"), ("correct_dps", "PASSED"),
                        ("wrong_values", "INCORRECT_NUMERICAL"), ("missing_dep", "MISSING_DEPENDENCY")}
    assert ray_run.isolation == local.isolation and {t.isolation for t in ray_run.traces} == {local.isolation}


def test_one_trace_line_per_pair_with_speedups(ray_run):
    records = [json.loads(line) for line in ray_run.trace_file.read_text().splitlines()]
    pairs = [(r["solution"], r["workload_name"]) for r in records]
    assert len(pairs) == len(set(pairs)) == 10
    assert [r["solution"] for r in records[:2]] == ["reference", "reference"]
    for record in records:
        if record["status"] == "PASSED":
            assert record["performance"]["speedup"] > 0 and record["environment"]["device"] == "cpu"


def test_no_worker_files_outlive_their_tasks(ray_run):
    assert ray_run.worker_files_left == []


def test_without_ray_the_error_is_one_line(module_repo, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    result = CliRunner().invoke(main, ["--root", str(module_repo), "run", "--def", "mla_paged_decode",
                                       "--backend", "ray", "--device", "cpu", "--trace-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "--backend ray needs Ray: pip install 'flashbench[ray]'" in result.output
    assert "Traceback" not in result.output
    with pytest.raises(FlashbenchError, match="needs Ray"):
        run_with(module_repo, tmp_path / "cache", tmp_path, "ray")


# A task, run here rather than by Ray: JSON text the driver parses.

@pytest.fixture(scope="module")
def task_setting(repo_copy, shared_cache, tmp_path_factory):
    repo = Repo(repo_copy)
    options = RunOptions(device="cpu", iters=2, warmup=0, timeout=60, cache_dir=shared_cache,
                         trace_dir=tmp_path_factory.mktemp("traces"))
    runner = Runner(repo, DEFINITION, options)
    config = JudgeConfig.for_run(runner.definition, repo.root, repo.definition_path(DEFINITION), options,
                                 runner.hardware)
    candidates = runner.candidates(select_solutions(repo, DEFINITION, [str(FIXTURES / "correct_dps"),
                                                                       str(FIXTURES / "missing_dep")]))
    workload = select_workloads(repo, DEFINITION, ["smoke_mixed"], "cpu")[0]
    return config, {c.solution.name: c for c in candidates}, workload


def test_a_task_judges_its_job_in_a_worker_of_its_own(task_setting, shared_cache, monkeypatch):
    config, candidates, workload = task_setting
    started = []
    start_worker = JobJudge.start_worker
    monkeypatch.setattr(JobJudge, "start_worker", lambda self, candidate, device, cpus=None: started.append(cpus)
                        or start_worker(self, candidate, device, cpus))
    answer = TaskAnswer.model_validate_json(job_task(config, Job(0, candidates["correct_dps"], workload), "cpu"))
    assert answer.device_error == "" and answer.outcome.status == "PASSED" and answer.outcome.timing
    assert [len(cpus) for cpus in started] == [1]  # a CPU task's worker keeps to one CPU, as a local lane's
    assert answer.environment["device"] == "cpu" and answer.environment["hardware"] == config.hardware
    workers = shared_cache / "workers"
    assert not workers.exists() or list(workers.iterdir()) == []  # the task closed its worker


def test_a_task_for_a_candidate_that_cannot_run_starts_no_worker(task_setting):
    config, candidates, workload = task_setting
    answer = TaskAnswer.model_validate_json(job_task(config, Job(0, candidates["missing_dep"], workload), "cpu"))
    assert answer.outcome.status == "MISSING_DEPENDENCY" and answer.device_error == ""


def test_a_task_on_a_device_it_cannot_use_says_so(task_setting):
    config, candidates, workload = task_setting
    answer = TaskAnswer.model_validate_json(job_task(config, Job(0, candidates["correct_dps"], workload), "nodevice"))
    assert answer.outcome is None and answer.device_error.startswith("it cannot be described")


# The driver's rules, on a fake Ray.

class FakeRay:
    """ray.remote / wait / get / cancel / init / shutdown; `answers(job, tries)` gives each task's
    result: JSON text, or an exception that `get` raises."""

    class exceptions:
        class RayError(Exception):
            pass

    def __init__(self, answers, initialized=False):
        self.answers = answers
        self.initialized = initialized
        self.results: dict[int, object] = {}
        self.submitted: list[tuple[int, str]] = []
        self.cancelled: list[int] = []
        self.events: list[str] = []
        self.resources: dict = {}

    def remote(self, max_retries, **resources):
        self.resources = {"max_retries": max_retries, **resources}
        return lambda function: SimpleNamespace(remote=self._submit)

    def _submit(self, config, job, device):
        task = len(self.results)
        self.submitted.append((job.index, device))
        self.results[task] = self.answers(job, sum(1 for index, _ in self.submitted if index == job.index))
        return task

    def wait(self, tasks, num_returns):
        return tasks[:num_returns], tasks[num_returns:]

    def get(self, task):
        result = self.results[task]
        if isinstance(result, Exception):
            raise result
        return result

    def cancel(self, task, force):
        self.cancelled.append(task)

    def is_initialized(self):
        return self.initialized

    def init(self, address=None, log_to_driver=True):
        self.events.append(f"init {address}")
        self.initialized = True

    def shutdown(self):
        self.events.append("shutdown")
        self.initialized = False


HARDWARE = "CPU test"


def passed(job) -> str:
    return TaskAnswer(outcome=JobOutcome(status="PASSED", message=f"job {job.index}"),
                      environment={"device": "cpu", "hardware": HARDWARE}).model_dump_json()


def device_failed(job) -> str:
    return TaskAnswer(device_error="the device check failed: broken").model_dump_json()


class FakeJudge:
    def __init__(self, failures=()):
        self.failures = set(failures)

    def known_failure(self, candidate):
        if candidate.solution.name in self.failures:
            return JobOutcome(status="MISSING_DEPENDENCY", message="not installed: xyz")
        return None


def backend(monkeypatch, answers, device="cpu", failures=(), initialized=False, address=None):
    fake = FakeRay(answers, initialized)
    monkeypatch.setattr(ray_backend, "import_ray", lambda: fake)
    config = SimpleNamespace(options=RunOptions(device=device, ray_address=address), hardware=HARDWARE)
    return RayBackend(config, FakeJudge(failures)), fake


def jobs(count, names=("s",)) -> list[Job]:
    return [Job(i, SimpleNamespace(solution=SimpleNamespace(name=names[i % len(names)])), SimpleNamespace(name=f"w{i}"))
            for i in range(count)]


def test_every_job_is_a_task_and_its_answer_is_parsed(monkeypatch):
    ray, fake = backend(monkeypatch, lambda job, tries: passed(job), address="ray://head:10001")
    with ray:
        done = list(ray.run(jobs(3)))
    assert [(job.index, outcome.status, outcome.message) for job, outcome, _ in done] == \
        [(i, "PASSED", f"job {i}") for i in range(3)]
    assert all(environment["hardware"] == HARDWARE for _, _, environment in done)
    assert fake.submitted == [(0, "cpu"), (1, "cpu"), (2, "cpu")]
    assert fake.resources == {"max_retries": 0, "num_cpus": 1}  # Ray never retries on its own
    assert fake.events == ["init ray://head:10001", "shutdown"]


def test_on_gpus_a_task_holds_one_and_sees_it_as_cuda(monkeypatch):
    ray, fake = backend(monkeypatch, lambda job, tries: passed(job), device="cuda:1")
    with ray:
        list(ray.run(jobs(1)))
    assert fake.resources == {"max_retries": 0, "num_gpus": 1} and fake.submitted == [(0, "cuda")]


def test_a_ray_instance_already_running_is_left_running(monkeypatch):
    ray, fake = backend(monkeypatch, lambda job, tries: passed(job), initialized=True)
    with ray:
        list(ray.run(jobs(1)))
    assert fake.events == [] and fake.initialized


def test_a_candidate_that_cannot_run_gets_no_task(monkeypatch):
    ray, fake = backend(monkeypatch, lambda job, tries: passed(job), failures={"broken"})
    with ray:
        done = list(ray.run(jobs(4, names=("broken", "s"))))
    assert sorted((job.index, outcome.status) for job, outcome, _ in done) == \
        [(0, "MISSING_DEPENDENCY"), (1, "PASSED"), (2, "MISSING_DEPENDENCY"), (3, "PASSED")]
    assert [index for index, _ in fake.submitted] == [1, 3]


@pytest.mark.parametrize("first_try", [
    lambda job: device_failed(job),
    lambda job: FakeRay.exceptions.RayError("the worker died\nTraceback ..."),
    lambda job: "not the JSON of an answer",
    lambda job: json.dumps({"outcome": {"status": "PASSED", "worker_usable": "certainly not"}}),
])
def test_a_job_whose_device_fails_is_submitted_once_more(monkeypatch, first_try):
    ray, fake = backend(monkeypatch, lambda job, tries: first_try(job) if tries == 1 else passed(job))
    with ray:
        done = list(ray.run(jobs(2)))
    assert sorted((job.index, outcome.status) for job, outcome, _ in done) == [(0, "PASSED"), (1, "PASSED")]
    assert sorted(fake.submitted) == [(0, "cpu"), (0, "cpu"), (1, "cpu"), (1, "cpu")]


def test_a_job_whose_device_fails_twice_ends_the_run(monkeypatch):
    ray, fake = backend(monkeypatch, lambda job, tries: device_failed(job))
    with pytest.raises(FlashbenchError) as failed:
        with ray:
            list(ray.run(jobs(2)))
    assert f"s on w0: the device failed {TRIES} times: the device check failed: broken" in str(failed.value)
    assert "\n" not in str(failed.value)
    assert fake.cancelled and fake.events[-1] == "shutdown"  # the tasks still in flight were cancelled


@pytest.mark.parametrize("answer, reason", [
    (lambda job: FakeRay.exceptions.RayError("the worker died\nTraceback ..."),
     "the judge's Ray task died: the worker died (2 times)"),
    (lambda job: "not the JSON of an answer", "the judge's Ray task answered nothing readable: "),
])
def test_a_job_whose_task_dies_twice_is_crashed_and_the_run_goes_on(monkeypatch, answer, reason):
    """The solution may have killed its task (a worker filling the node's memory made Ray's monitor kill the judge's
    task): that ends its pair, not the run, as the kernel's OOM killer taking a worker does in a local run."""
    ray, fake = backend(monkeypatch, lambda job, tries: answer(job) if job.index == 0 else passed(job))
    with ray:
        done = list(ray.run(jobs(2)))
    assert sorted((job.index, outcome.status) for job, outcome, _ in done) == [(0, "CRASHED"), (1, "PASSED")]
    ((crashed, environment),) = [(outcome, environment) for job, outcome, environment in done if job.index == 0]
    assert crashed.message.startswith(reason) and "\n" not in crashed.message
    assert environment == {TASK_DIED_KEY: True}  # Ray may have killed it for another's worker: --resume runs it again
    assert sorted(fake.submitted) == [(0, "cpu"), (0, "cpu"), (1, "cpu")]


def test_a_task_on_other_hardware_ends_the_run(monkeypatch):
    other = TaskAnswer(outcome=JobOutcome(status="PASSED"), environment={"hardware": "NVIDIA H100"}).model_dump_json()
    ray, _ = backend(monkeypatch, lambda job, tries: other)
    with pytest.raises(FlashbenchError, match=f"a Ray task ran on NVIDIA H100, not {HARDWARE} like the driver"):
        with ray:
            list(ray.run(jobs(1)))


def test_the_running_jobs_are_those_in_flight(monkeypatch):
    ray, _ = backend(monkeypatch, lambda job, tries: passed(job))
    with ray:
        for job, _, _ in ray.run(jobs(3)):
            assert job.index not in ray.running()
            assert ray.running() == set(range(job.index + 1, 3))


def test_a_task_whose_machine_refuses_the_worker_uid_asked_for_says_so_as_a_device_failure(task_setting, monkeypatch):
    """A root Ray node where the FLASHBENCH_WORKER_UID named cannot serve refuses it (never root instead): the task
    raised, Ray reported it as a task that died, and every job on that node was recorded CRASHED against its
    solution. It is the machine's failure: the driver tries again, then ends the run with the reason."""
    from flashbench.run import sandbox
    config, candidates, workload = task_setting
    monkeypatch.setattr(sandbox, "_reach_problem", lambda uid, reachable: "cannot read /opt/venv")
    monkeypatch.setattr(sandbox, "_umask", lambda: 0o022)
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0)
    monkeypatch.setenv(sandbox.WORKER_UID_VARIABLE, "4242")
    started = []
    monkeypatch.setattr("flashbench.run.jobs.WorkerProcess.start", lambda *args, **kwargs: started.append(args))
    sandbox._root_runner_account.cache_clear()
    try:
        answer = TaskAnswer.model_validate_json(job_task(config, Job(0, candidates["correct_dps"], workload), "cpu"))
    finally:
        sandbox._root_runner_account.cache_clear()
    assert answer.outcome is None and answer.device_error.startswith("FLASHBENCH_WORKER_UID=4242, but cannot read")
    assert started == []
