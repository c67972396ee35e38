"""Which recorded results `--resume` skips: those that say something about the solution. An outcome
that came from the machine it ran on (a package, a GPU or a compiler missing there) is run again."""

import re

from ..model import Trace

# Build failures that name a missing tool rather than a fault in the sources: the phrases
# torch.utils.cpp_extension, the shell and the runner use when CUDA, nvcc or ninja is absent.
MISSING_TOOLCHAIN = re.compile(
    r"needs a CUDA device"
    r"|CUDA_HOME environment variable is not set"
    r"|CUDA was not found on the system"
    r"|Torch not compiled with CUDA enabled"
    r"|Found no NVIDIA driver"
    r"|\bnvcc(?::\s*(?:command\s+)?not found| not found at)"
    r"|No such file or directory: '[^']*/nvcc'"
    r"|Ninja is required",
    re.IGNORECASE,
)

BUILD_FAILURES = ("COMPILE_ERROR", "INVALID_SOLUTION")


def settled(trace: Trace) -> bool:
    """Whether a recorded trace counts as done for `--resume`. Timeouts and crashes are the
    solution's and stay settled."""
    if trace.status == "MISSING_DEPENDENCY":
        return False
    if trace.status in BUILD_FAILURES:
        return not MISSING_TOOLCHAIN.search(trace.message)
    return True
