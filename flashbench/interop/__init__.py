"""Moving datasets between flashbench and FlashInfer-Bench (FIB): import, export, and running a FIB
solution JSON as it is.

fib_model holds FIB's file formats and layout (and flashbench's extensions to them); fib_import and
fib_export convert, saying what one side cannot express instead of guessing; fib_solution turns FIB
solution records into solution folders and back.
"""

from .fib_export import export_fib
from .fib_import import import_fib, imported_trace_dir
from .fib_solution import solution_from_fib_json
from .summary import Summary

__all__ = ["Summary", "export_fib", "import_fib", "imported_trace_dir", "solution_from_fib_json"]
