"""The one error type flashbench raises for bad input: it names the file and the field."""


class FlashbenchError(Exception):
    """A problem a person can act on. The CLI prints it as one line and exits 2."""

    def __init__(self, message: str, file: object = None, field: str | None = None):
        self.message = message
        self.file = str(file) if file is not None else None
        self.field = field
        super().__init__(str(self))

    @property
    def detail(self) -> str:
        """The field and the message, without the file (where the file is said already)."""
        return ": ".join(part for part in (self.field, self.message) if part)

    def __str__(self) -> str:
        return ": ".join(part for part in (self.file, self.detail) if part)


def shortened(text: str, limit: int = 200) -> str:
    """`text` cut to at most `limit` characters for a message, "..." included where it was cut (what it quotes may
    come from anyone, at any length; a message field may hold no more than its limit)."""
    return text if len(text) <= limit else text[:max(limit - 3, 0)] + "..."
