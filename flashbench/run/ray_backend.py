"""Jobs as Ray tasks: a run spread over the GPUs of a Ray cluster (or a local Ray instance).

Every (candidate, workload) job is one task holding one GPU (one CPU where there is none), so
Ray never places two jobs on one device. A task is judge-side code: it builds a JobJudge from the
run's plain settings, starts the solution's sandboxed worker as a local run does, judges the job
(references computed in the task, on its device) and returns the outcome as JSON text, which the
driver parses like any other untrusted reply. The driver writes every trace.

A task whose device fails (the task says so, before any solution code runs on it) is submitted again; a
job whose device fails twice ends the run. A task that dies or answers nothing readable once solution code
may have run is submitted again too, and a job whose task dies twice is CRASHED: the solution may have
caused it (a worker filling the node's memory made Ray's monitor kill the judge's task), so it ends that
pair, not the run; the monitor may have picked it for another task's worker, so `--resume` runs it again.
Paths (solution folders, the build cache, workload files) are the driver's: the workers must see the same
file system.
"""

import signal
import threading

from pydantic import BaseModel, ValidationError

from ..errors import FlashbenchError
from ..registry import use_root
from .jobs import DeviceUnusable, JobJudge, JudgeConfig
from .plan import Job
from .pool import lane_cpus
from .resume import TASK_DIED_KEY
from .session import JobOutcome

TRIES = 2  # tasks a job gets when its device fails or its task dies


class TaskAnswer(BaseModel):
    outcome: JobOutcome | None = None
    environment: dict = {}
    device_error: str = ""


def import_ray():
    try:
        import ray
    except ImportError:
        raise FlashbenchError("--backend ray needs Ray: pip install 'flashbench[ray]'") from None
    return ray


def job_task(config: JudgeConfig, job: Job, device: str) -> str:
    """On a Ray worker: one job in a fresh sandboxed worker, which is closed after it."""
    use_root(config.root)  # the inputs made here find the FP8 quantize reference in the run's repository
    judge = JobJudge(config)
    try:
        # This machine's settings, before anything runs: a worker uid named that cannot serve here is the machine's
        # failure (the driver tries again, then ends the run with it), not a task that died (CRASHED, the solution's)
        config.worker_account()
    except FlashbenchError as exc:
        return TaskAnswer(device_error=str(exc)).model_dump_json()
    try:
        environment = judge.environment_of(device)
        if judge.lacks_clean_steps(job, device):  # before any solution code runs on the device
            judge.measure_clean_steps(job.workload, device)
        # A CPU task's worker keeps to one CPU, as a local CPU lane's (pool.lane_cpus)
        worker = None if judge.known_failure(job.candidate) else judge.start_worker(job.candidate, device,
                                                                                    lane_cpus([device])[0])
    except DeviceUnusable as exc:
        return TaskAnswer(device_error=str(exc)).model_dump_json()
    if worker is None:
        return TaskAnswer(outcome=judge.known_failure(job.candidate), environment=environment).model_dump_json()
    try:
        judge.references_for(job.workload, device)
        outcome = judge.run(worker, job, device)
    finally:
        worker.close()
    return TaskAnswer(outcome=outcome, environment=environment).model_dump_json()


class RayBackend:
    """The Ray backend: `run` submits jobs and yields (job, outcome, environment) as their tasks finish."""

    def __init__(self, config: JudgeConfig, judge: JobJudge):
        self.ray = import_ray()
        self.config = config
        self.judge = judge
        # Ray shows a task only the GPU it holds, as cuda:0.
        self.device = "cuda" if config.options.on_gpu else "cpu"
        resources = {"num_gpus": 1} if config.options.on_gpu else {"num_cpus": 1}
        self._job = self.ray.remote(max_retries=0, **resources)(job_task)  # resubmitted only when the device failed
        self._in_flight: dict = {}  # task -> (job, tries so far)
        self._started = False

    def __enter__(self):
        if not self.ray.is_initialized():
            # Ray's own SIGTERM handler (sys.exit) replaced the command's, which ends a run as Ctrl-C does
            main = threading.current_thread() is threading.main_thread()
            handler = signal.getsignal(signal.SIGTERM) if main else None
            self.ray.init(address=self.config.options.ray_address, log_to_driver=False)
            if main:
                signal.signal(signal.SIGTERM, handler)
            self._started = True
        return self

    def __exit__(self, kind, error, tb):
        for task in self._in_flight:
            self.ray.cancel(task, force=True)
        self._in_flight.clear()
        if self._started:
            self.ray.shutdown()

    def run(self, jobs):
        for job in jobs:
            failure = self.judge.known_failure(job.candidate)
            if failure is not None:
                yield job, failure, {}
            else:
                self._submit(job, 1)
        while self._in_flight:
            (task,), _ = self.ray.wait(list(self._in_flight), num_returns=1)
            job, tries = self._in_flight.pop(task)
            try:
                answer = TaskAnswer.model_validate_json(self.ray.get(task))
            except (self.ray.exceptions.RayError, ValidationError) as exc:
                died = (f"the judge's Ray task died: {(str(exc).splitlines() or [type(exc).__name__])[0]}"
                        if isinstance(exc, self.ray.exceptions.RayError)
                        else f"the judge's Ray task answered nothing readable: {exc.errors()[0]['msg']}")
                if tries < TRIES:
                    self._submit(job, tries + 1)
                else:
                    yield job, JobOutcome(status="CRASHED", message=f"{died} ({tries} times)"), {TASK_DIED_KEY: True}
                continue
            if answer.device_error:
                self._again(job, tries, answer.device_error)
                continue
            hardware = answer.environment.get("hardware")
            if hardware and hardware != self.config.hardware:
                raise FlashbenchError(f"a Ray task ran on {hardware}, not {self.config.hardware} like the driver; "
                                      "run one kind of device per run")
            yield job, answer.outcome, answer.environment

    def running(self) -> set[int]:
        """The jobs submitted and not yet recorded."""
        return {job.index for job, _ in self._in_flight.values()}

    def _submit(self, job: Job, tries: int) -> None:
        self._in_flight[self._job.remote(self.config, job, self.device)] = (job, tries)

    def _again(self, job: Job, tries: int, reason: str) -> None:
        if tries >= TRIES:
            raise FlashbenchError(f"{job.candidate.solution.name} on {job.workload.name}: the device failed "
                                  f"{tries} times: {reason}")
        self._submit(job, tries + 1)
