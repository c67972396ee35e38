"""The `flashbench` command: a thin layer over the Python API, one module per command."""

import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from ..errors import FlashbenchError

# Not a terminal (a log, CI): wide enough that result tables stay on one line per row.
console = Console() if sys.stdout.isatty() else Console(width=160)
errors = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


class Group(click.Group):
    """Prints a FlashbenchError as one line (no traceback) and exits 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except FlashbenchError as exc:
            errors.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            sys.exit(2)


@click.group(cls=Group)
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Repository root (default: $FLASHBENCH_ROOT or the nearest folder with definitions/).")
@click.version_option(package_name="flashbench")
@click.pass_context
def main(ctx, root):
    """flashbench: definitions, solutions and honest timing for GPU kernels."""
    ctx.obj = root


def repo_from(ctx):
    from ..registry import Repo
    return Repo(ctx.obj)


from . import calibrate, definitions, interop, leaderboard, run  # noqa: E402,F401  (registers the commands)
