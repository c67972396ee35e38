"""Moving datasets between flashbench and FlashInfer-Bench (FIB): import and export.

fib_model holds FIB's file formats and layout; fib_import and fib_export convert, saying what
one side cannot express instead of guessing.
"""

from .fib_export import export_fib
from .fib_import import import_fib
from .summary import Summary

__all__ = ["Summary", "export_fib", "import_fib"]
