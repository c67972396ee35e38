"""What an import or export did, as rows of a table: per definition and kind of record, what came
across, what did not, and why. Rows with the same definition, kind, outcome and reason are merged
into one with a count, so a thousand imported traces make one row and every skip keeps its own."""

from typing import Literal

from pydantic import BaseModel

Kind = Literal["definition", "workload", "solution", "trace", "blob", "file"]
Outcome = Literal["imported", "exported", "unchanged", "skipped", "ignored", "failed"]
KINDS: tuple[Kind, ...] = ("definition", "workload", "blob", "solution", "trace", "file")
DONE: tuple[Outcome, ...] = ("imported", "exported")


class Row(BaseModel):
    definition: str = ""  # "" for what belongs to no definition (a file that is no record)
    kind: Kind
    outcome: Outcome
    count: int = 1
    why: str = ""


class Summary(BaseModel):
    rows: list[Row] = []

    def add(self, definition: str, kind: Kind, outcome: Outcome, why: str = "", count: int = 1) -> None:
        for row in self.rows:
            if (row.definition, row.kind, row.outcome, row.why) == (definition, kind, outcome, why):
                row.count += count
                return
        self.rows.append(Row(definition=definition, kind=kind, outcome=outcome, why=why, count=count))

    def extend(self, other: "Summary") -> None:
        for row in other.rows:
            self.add(row.definition, row.kind, row.outcome, row.why, row.count)

    def count(self, kind: Kind, outcome: Outcome | None = None) -> int:
        """Records of a kind that came across (imported or exported), or with the given outcome."""
        wanted = (outcome,) if outcome else DONE
        return sum(r.count for r in self.rows if r.kind == kind and r.outcome in wanted)

    @property
    def failed(self) -> list[Row]:
        return [r for r in self.rows if r.outcome == "failed"]

    @property
    def notes(self) -> list[Row]:
        """Every row that says why: skips, ignored files, failures and what was carried with a caveat."""
        return [r for r in self.rows if r.why]

    def table_rows(self) -> list[Row]:
        """Grouped by definition (the dataset's own files last), then by kind."""
        return sorted(self.rows, key=lambda r: (r.definition == "", r.definition, KINDS.index(r.kind)))

    def line(self, verb: str) -> str:
        done = ", ".join(f"{self.count(k)} {k}{'s' if self.count(k) != 1 else ''}" for k in KINDS[:-1])
        others = {o: sum(r.count for r in self.rows if r.outcome == o) for o in ("skipped", "ignored", "failed")}
        return f"{verb} {done}; " + ", ".join(f"{n} {o}" for o, n in others.items())
