"""The one error type flashbench raises for bad input: it names the file and the field."""


class FlashbenchError(Exception):
    """A problem a person can act on. The CLI prints it as one line and exits 2."""

    def __init__(self, message: str, file: object = None, field: str | None = None):
        self.message = message
        self.file = str(file) if file is not None else None
        self.field = field
        super().__init__(str(self))

    def __str__(self) -> str:
        parts = [p for p in (self.file, self.field) if p]
        return ": ".join(parts + [self.message])
