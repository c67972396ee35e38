"""Running solutions: sandboxed workers (run/worker/), the judge outside them (run/session.py,
run/judge/), backends (local devices, Ray) and the orchestrating runner.

The names below load on first use, so a worker process, which imports run/worker/ and the
protocol, never loads the judge's modules.
"""

import importlib

_EXPORTS = {
    "RunOptions": "options", "Candidate": "plan", "install_solution": "plan", "installed_path": "plan",
    "select_solutions": "plan", "select_workloads": "plan", "parse_devices": "pool", "device_threads_left": "pool",
    "RunResult": "runner", "Runner": "runner", "default_device": "runner",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
