"""Which recorded results `--resume` skips: all but those the judge, not the solution, is known to answer
for (settled): MISSING_DEPENDENCY, which only the judge writes, from its own checks before any worker starts
(run/jobs.py _failure_before_start: a package, a CUDA device, nvcc or ninja missing here; a worker cannot
report it, protocol.FailureStatus), a TIMEOUT under a shorter limit than the run's, the judge's own rejection
for a changed trace file where no worker could change it, and records measured or judged otherwise. Whatever a
worker reports, a COMPILE_ERROR naming a missing nvcc included, is the solution's and stays recorded: were it
believed, a solution could void every run it did not like and keep its best attempt."""

from ..model import Trace
from .recorder import CHANGED_FILE_KEY
from .sandbox import ISOLATION_LEVELS

RUN_AGAIN = "MISSING_DEPENDENCY"
# In the environment of a pair whose judge's Ray task died twice (CRASHED): Ray's memory monitor may have killed it
# for another task's worker, so the pair is no verdict on its solution, and --resume runs it again.
TASK_DIED_KEY = "judge_task_died"
# Raised whenever a change to the judge (how inputs are drawn and redrawn, what is checked, how the sandbox holds a
# worker) could turn a verdict: every trace the judge writes records it (`environment["judge"]`), and --resume runs
# again a record of another, whatever its status. Without it a PASSED that a since-fixed hole let through, or a
# failure a since-fixed judge gave an honest solution, was kept by every later --resume (the checks' digest covers
# the definition and its reference, not the harness).
# 2: a solution's exception never ends its worker (CRASHED became RUNTIME_ERROR); 3: integer, boolean and FP4 outputs
# poisoned with random values (a constant passed an unwritten element whose value it was), paths in a folder bounded;
# 4: a sampling definition's jobs check at least MIN_CHECKED_SAMPLES samples (an argmax sampler passed on a few);
# 5: the inputs are sampled when a batch's reply arrives (a worker that wrote part of them after replying passed),
# and a folder with a refused link is refused before it is staged; 6: a folder is walked and read through
# descriptors only (a sub-folder swapped for a link while it was staged had a file from outside staged).
JUDGE_VERSION = 6
TIMEOUT_KEY = "timeout_s"  # the run's --timeout, in every trace's environment


def settled(trace: Trace, isolation: str | None = None, timing: dict | None = None,
            timeout: float | None = None) -> bool:
    """Whether a recorded trace counts as done for `--resume` in a run whose workers are isolated at level
    `isolation` and whose timed results record `timing` (those keys of Performance.timing: the L2 flush,
    whether the seeds were public), by this version of the judge. A record made with its worker less isolated
    than the run's is run again: a solution that cheats only where it can see other processes kept such a
    record, and the run said its workers were isolated more strongly. So is a time measured otherwise: after
    another flush, on inputs whose seeds were public (known to the solution before it ran), with other call
    counts, or judged by other checks (the definition's tolerances or reference changed, or another number of
    checked calls). So is a TIMEOUT under a shorter `timeout` than the run's (or an unknown one: the user's
    option, not the solution's verdict), and the judge's own rejection of a pair during which someone else
    changed the trace file, where that cannot have been its worker (level namespaces hides the trace directory;
    at level process a worker could write it, and so buy itself another try)."""
    if trace.status == RUN_AGAIN or trace.environment.get("judge") != JUDGE_VERSION:
        return False
    if trace.environment.get(TASK_DIED_KEY) is True:
        return False
    if trace.status == "TIMEOUT" and timeout is not None and not _at_least(trace.environment.get(TIMEOUT_KEY), timeout):
        return False
    if trace.environment.get(CHANGED_FILE_KEY) is True and trace.isolation == "namespaces":
        return False
    if isolation is not None and _strength(trace.isolation) < _strength(isolation):
        return False
    if trace.performance is None:  # a failure; a PASSED without a time is no record the judge wrote
        return trace.status != "PASSED"
    recorded = trace.performance.timing
    return recorded is None or all(recorded.get(key) == value for key, value in (timing or {}).items())


def _strength(isolation: str | None) -> int:
    """Higher is stronger; a level this version does not know is the weakest."""
    return len(ISOLATION_LEVELS) - ISOLATION_LEVELS.index(isolation) if isolation in ISOLATION_LEVELS else 0


def _at_least(recorded: object, timeout: float) -> bool:
    return isinstance(recorded, (int, float)) and not isinstance(recorded, bool) and recorded >= timeout
