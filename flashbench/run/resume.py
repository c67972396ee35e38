"""Which recorded results `--resume` skips: all but MISSING_DEPENDENCY, the one failure that says the
machine, not the solution, was at fault. Only the judge writes it, from its own checks before any worker
starts (run/jobs.py _failure_before_start: a package, a CUDA device, nvcc or ninja missing here); a worker
cannot report it (protocol.FailureStatus). Whatever a worker reports, a COMPILE_ERROR naming a missing
nvcc included, is the solution's and stays recorded: were it believed, a solution could void every run
it did not like and keep its best attempt."""

from ..model import Trace

RUN_AGAIN = "MISSING_DEPENDENCY"


def settled(trace: Trace) -> bool:
    """Whether a recorded trace counts as done for `--resume`."""
    return trace.status != RUN_AGAIN
