"""Jobs as Ray tasks: a run spread over the GPUs of a Ray cluster (or a local Ray instance).

Every (candidate, workload) job is one task holding one GPU (one CPU where there is none), so
Ray never places two jobs on one device. A task starts a worker process for the solution just as
a local run does (the device check, the build, the job) and returns what the worker answered;
the driver alone reaches the verdict against the references and writes the traces. Reference
outputs are tasks too, holding a device like a job, so the driver never computes on a GPU while
a job is timed on it; they are kept in the driver's memory for the run, never on disk.

A task whose device fails (its worker fails the device check, or the Ray task itself fails) is
submitted again; a job whose device fails twice ends the run. Paths (solution folders, the
build cache, workload files) are the driver's: the workers must see the same file system.
"""

from ..environment import hardware_name
from ..errors import FlashbenchError
from ..reference import load_reference
from . import process
from .process import DeviceUnusable
from .references import reference_outputs

TRIES = 2  # tasks a job gets when its device fails


def import_ray():
    try:
        import ray
    except ImportError:
        raise FlashbenchError("--backend ray needs Ray: pip install 'flashbench[ray]'") from None
    return ray


def job_task(config: dict, request: dict, timeout: float, on_gpu: bool) -> dict:
    """On a Ray worker: one job in a fresh worker process, which is closed after it."""
    try:
        worker, failure = process.start_worker(config, timeout)
    except DeviceUnusable as exc:
        return {"device_error": str(exc)}
    try:
        outcome = failure or process.run_job(worker, request, timeout, on_gpu)
    finally:
        worker.close()
    return {"outcome": outcome, "hardware": hardware_name(config["device"])}


def reference_task(definition, root: str, definition_file: str, source: str, workload, seed: int, variant: int,
                   device: str, base_dir: str) -> dict:
    """On a Ray worker: the reference's outputs for one (seed, variant) of a workload."""
    from pathlib import Path

    run = load_reference(definition, Path(root), Path(definition_file))
    return reference_outputs(definition, run, source, workload, seed, device, Path(base_dir), None, variant)


class RayBackend:
    """The Ray backend: `run` submits jobs and yields (job, trace) as their tasks finish."""

    def __init__(self, runner):
        self.ray = import_ray()
        self.runner = runner
        # Ray shows a task only the GPU it holds, as cuda:0.
        self.device = "cuda" if runner.on_gpu else "cpu"
        resources = {"num_gpus": 1} if runner.on_gpu else {"num_cpus": 1}
        # No retries by Ray: a task is submitted again only when its device failed.
        self._job = self.ray.remote(max_retries=0, **resources)(job_task)
        self._reference = self.ray.remote(max_retries=0, **resources)(reference_task)
        self._in_flight: dict = {}  # task -> (job, tries so far)
        self._started = False

    def __enter__(self):
        if not self.ray.is_initialized():
            self.ray.init(address=self.runner.options.ray_address, log_to_driver=False)
            self._started = True
        return self

    def __exit__(self, kind, error, tb):
        for task in self._in_flight:
            self.ray.cancel(task, force=True)
        self._in_flight.clear()
        if self._started:
            self.ray.shutdown()

    def run(self, jobs):
        runner = self.runner
        for workload in {job.workload.uuid: job.workload for job in jobs}.values():
            runner.settle_references(workload, self.device)
        for job in jobs:
            failure = runner.known_failure(job.candidate)
            if failure is not None:
                yield job, runner.judge(job, failure, runner.options.device)
            else:
                self._submit(job, 1)
        while self._in_flight:
            (task,), _ = self.ray.wait(list(self._in_flight), num_returns=1)
            job, tries = self._in_flight.pop(task)
            try:
                answer = self.ray.get(task)
            except self.ray.exceptions.RayError as exc:
                answer = {"device_error": f"the Ray task failed: {str(exc).splitlines()[0]}"}
            if "device_error" in answer:
                self._again(job, tries, answer["device_error"])
                continue
            if answer["hardware"] != runner.environment["hardware"]:
                raise FlashbenchError(f"a Ray task ran on {answer['hardware']}, not {runner.environment['hardware']} "
                                      "like the driver; run one kind of device per run")
            yield job, runner.judge(job, answer["outcome"], self.device)

    def running(self) -> set[int]:
        """The jobs submitted and not yet recorded."""
        return {job.index for job, _ in self._in_flight.values()}

    def reference_outputs(self, workload, keys, device):
        runner = self.runner
        tasks = [
            self._reference.remote(runner.definition, str(runner.repo.root), str(runner.repo.definition_path(runner.definition.name)),
                                   runner.reference_source, workload, seed, variant, device, str(runner.base_dir))
            for seed, variant in keys
        ]
        return self.ray.get(tasks)

    def _submit(self, job, tries: int) -> None:
        runner = self.runner
        config = runner.worker_config(job.candidate, self.device)
        task = self._job.remote(config, runner.job_request(job), runner.options.timeout, runner.on_gpu)
        self._in_flight[task] = (job, tries)

    def _again(self, job, tries: int, reason: str) -> None:
        if tries >= TRIES:
            raise FlashbenchError(f"{job.candidate.solution.name} on {job.workload.name}: the device failed "
                                  f"{tries} times: {reason}")
        self._submit(job, tries + 1)
