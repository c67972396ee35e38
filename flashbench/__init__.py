"""flashbench: a benchmark-definition registry and honest timing harness for GPU kernels.

The data flows one way: definition -> workload -> inputs -> build -> run -> check -> time -> trace.
"""

from .binding import BindingError, bind_axes
from .errors import FlashbenchError
from .model import Definition, Solution, Workload, WorkloadSet
from .registry import Repo
from .validate import validate
from .workloads import generate_inputs

__version__ = "0.1.0"

__all__ = [
    "BindingError", "Definition", "FlashbenchError", "Repo", "Solution", "Workload", "WorkloadSet",
    "bind_axes", "generate_inputs", "validate", "__version__",
]
