"""The `flashbench` command: a thin layer over the Python API, one module per command."""

import signal
import sys
import threading
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from ..errors import FlashbenchError
from ..model.trace import printable_line

# Not a terminal (a log, CI): wide enough that result tables stay on one line per row.
console = Console() if sys.stdout.isatty() else Console(width=160)
errors = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
INTERRUPTED = 130  # a shell's exit code for a command ended by Ctrl-C (128 + SIGINT)


class Group(click.Group):
    """Prints a FlashbenchError, or a command's flags that do not fit, as one line (no traceback, no
    usage block) and exits 2; Ctrl-C (and SIGTERM) exits 130, as a shell's commands do (click's own handling
    would exit 1, which reads as a failed check)."""

    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except click.exceptions.NoArgsIsHelpError:  # a bare `flashbench`: the help, as click shows it
            raise
        except click.UsageError as exc:  # the group's own flags (--root)
            usage_error(exc)

    def invoke(self, ctx):
        main = threading.current_thread() is threading.main_thread()
        before = signal.signal(signal.SIGTERM, _terminated) if main else None
        try:
            return super().invoke(ctx)
        except FlashbenchError as exc:
            fail(shown(exc))
        except click.UsageError as exc:  # a command's flags, parsed here
            usage_error(exc)
        except KeyboardInterrupt:
            errors.print("interrupted", highlight=False)
            sys.exit(INTERRUPTED)
        finally:
            if main:  # a program that embeds the command keeps its own
                signal.signal(signal.SIGTERM, before)


def _terminated(signum, frame):
    """SIGTERM (`timeout`, CI, a service manager) ends a command as Ctrl-C does: a run prints the summary of the
    pairs that finished and how to continue, and its workers and their folders go (it ended with none of it)."""
    raise KeyboardInterrupt


def usage_error(exc: click.UsageError):
    command = exc.ctx.command_path if exc.ctx else "flashbench"  # no context: the group's own flags
    fail(f"{escape(exc.format_message())} See '{command} --help'.")


def shown(text) -> str:
    """Text from a file, or a folder's name, as markup that prints it as one line of text: a path through folders
    `a[` and `x]` ended `submit` with a traceback ("[/x]"), and escape sequences in names reached the terminal."""
    return escape(printable_line(str(text)))


def fail(markup: str):
    errors.print(f"[bold red]error:[/] {markup}", highlight=False, soft_wrap=True)
    sys.exit(2)


@click.group(cls=Group)
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Repository root (default: $FLASHBENCH_ROOT or the nearest folder with definitions/).")
@click.version_option(package_name="flashbench")
@click.pass_context
def main(ctx, root):
    """flashbench: definitions, solutions and honest timing for GPU kernels."""
    ctx.obj = root
    if root is not None:
        from ..registry import use_root
        use_root(root)


def repo_from(ctx):
    from ..registry import Repo
    if ctx.obj is not None and not Path(ctx.obj).is_dir():  # else: "no definition named ...; known: none"
        raise FlashbenchError("--root: no such folder", ctx.obj)
    return Repo(ctx.obj)


from ..api import resolve_device  # noqa: E402,F401  (the commands check --device with it)
from . import calibrate, definitions, interop, leaderboard, run  # noqa: E402,F401  (registers the commands)
