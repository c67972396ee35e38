"""Which recorded results `--resume` skips."""


def settled(trace) -> bool:
    """Outcomes that depended on the environment (a missing package) are run again."""
    return trace.status != "MISSING_DEPENDENCY"
