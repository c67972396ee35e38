"""Running solutions: worker processes, correctness checks, timing and the orchestrating runner."""

from .pool import parse_devices
from .runner import Candidate, RunOptions, RunResult, Runner, default_device, install_solution, select_solutions, select_workloads

__all__ = ["Candidate", "RunOptions", "RunResult", "Runner", "default_device", "install_solution", "parse_devices",
           "select_solutions", "select_workloads"]
