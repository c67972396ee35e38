"""flashbench/run/resume.py: which recorded results `--resume` skips."""

import pytest

from flashbench.run.resume import settled
from trace_factory import make_trace


def trace(status, message=""):
    return make_trace("s", "w", status=status).model_copy(update={"message": message})


@pytest.mark.parametrize("status", ["PASSED", "INCORRECT_NUMERICAL", "INCORRECT_SHAPE", "RUNTIME_ERROR", "TIMEOUT",
                                    "CRASHED", "REJECTED"])
def test_outcomes_of_the_solution_are_settled(status):
    assert settled(trace(status, "anything, even: nvcc: not found"))


def test_a_missing_dependency_runs_again():
    assert not settled(trace("MISSING_DEPENDENCY", "not installed: flashinfer"))
    assert not settled(trace("MISSING_DEPENDENCY", "a CUDA solution needs a CUDA device"))


@pytest.mark.parametrize("message", [
    "a CUDA solution needs a CUDA device",
    "building kernel.cu failed: CUDA_HOME environment variable is not set. Please set it to your CUDA install root.",
    "building kernel.cu failed: CUDA was not found on the system, please set the CUDA_HOME or the CUDA_PATH",
    "building kernel.cu failed: nvcc not found at '/usr/local/cuda/bin/nvcc'. Ensure CUDA path '/usr/local/cuda' is correct.",
    "building kernel.cu failed: Error building extension 'x': [1/3] ...\n/bin/sh: 1: /usr/local/cuda/bin/nvcc: not found\n",
    "building kernel.cu failed: /bin/bash: nvcc: command not found",
    "building kernel.cu failed: [Errno 2] No such file or directory: '/usr/local/cuda/bin/nvcc'",
    "building kernel.cu failed: Ninja is required to load C++ extensions (pip install ninja to get it)",
    "importing kernel.py failed: AssertionError('Torch not compiled with CUDA enabled')",
])
@pytest.mark.parametrize("status", ["COMPILE_ERROR", "INVALID_SOLUTION"])
def test_a_build_without_its_toolchain_runs_again(status, message):
    assert not settled(trace(status, message))


@pytest.mark.parametrize("message", [
    "building kernel.cu failed: Error building extension 'x':\nkernel.cu(12): error: identifier \"foo\" is undefined",
    "building kernel.cu failed: kernel.cu:3:10: fatal error: cutlass/cutlass.h: No such file or directory",
    "building kernel.cu failed: nvcc fatal   : Unsupported gpu architecture 'compute_100a'",
    "importing kernel.py failed: ModuleNotFoundError(\"No module named 'helpers'\")",
    "kernel.py has no function 'run'",
    "kernel.cu resolves outside the solution folder",
])
@pytest.mark.parametrize("status", ["COMPILE_ERROR", "INVALID_SOLUTION"])
def test_a_build_that_failed_on_its_sources_is_settled(status, message):
    assert settled(trace(status, message))
