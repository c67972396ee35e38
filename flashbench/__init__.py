"""flashbench: a benchmark-definition registry and honest timing harness for GPU kernels.

The data flows one way: definition -> workload -> inputs -> build -> run -> check -> time -> trace.
The Python API (flashbench/api.py, docs/python_api.md): `load` or `Registry`, `run`, `best`. Its names
load on first use, so a worker process, which imports this package, never loads the judge or pandas.
"""

import importlib
import types

from . import run as _run_package
from .binding import BindingError, bind_axes
from .errors import FlashbenchError
from .model import Definition, RunReport, Solution, Trace, Workload, WorkloadSet
from .registry import Repo
from .validate import validate
from .workloads import generate_inputs

__version__ = "0.1.0"


class _CallablePackage(types.ModuleType):
    """`flashbench.run` is the harness's package and, called, runs solutions: fb.run(...) is api.run(...).
    One name for both, since a function bound over the package would break `import flashbench.run.x as y`."""

    def __call__(self, *args, **kwargs) -> RunReport:
        from .api import run
        return run(*args, **kwargs)


_run_package.__class__ = _CallablePackage
_API = {"Best", "Registry", "best", "load"}

__all__ = [
    "BindingError", "Best", "Definition", "FlashbenchError", "Registry", "Repo", "RunReport", "Solution", "Trace",
    "Workload", "WorkloadSet", "best", "bind_axes", "generate_inputs", "load", "run", "validate", "__version__",
]


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(".api", __name__), name)
