"""What an import or export did: counts per kind of file, and what could not be carried over."""

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Summary:
    counts: Counter = field(default_factory=Counter)
    warnings: list[str] = field(default_factory=list)

    def warn(self, where: object, message: str) -> None:
        self.warnings.append(f"{where}: {message}")

    def line(self) -> str:
        kinds = ("definitions", "workloads", "blobs", "solutions", "traces")
        return ", ".join(f"{self.counts[k]} {k}" for k in kinds)
