"""pydantic models: the single source of truth for every file flashbench reads or writes."""

from .definition import Axis, CostModel, Definition, TensorSpec, Tolerance
from .loading import load_model, parse_document, parse_model, read_document
from .solution import Solution
from .workload import Lengths, PagedKV, Workload, WorkloadSet

__all__ = [
    "Axis", "CostModel", "Definition", "TensorSpec", "Tolerance", "Solution",
    "Lengths", "PagedKV", "Workload", "WorkloadSet", "load_model", "parse_document", "parse_model", "read_document",
]

from .trace import REFERENCE, OutputError, Performance, Status, Trace  # noqa: E402

__all__ += ["REFERENCE", "OutputError", "Performance", "Status", "Trace"]

from .calibration import Calibration  # noqa: E402

__all__ += ["Calibration"]

from .run_report import RUN_REPORT_FORMAT, PairResult, RunReport  # noqa: E402

__all__ += ["RUN_REPORT_FORMAT", "PairResult", "RunReport"]
