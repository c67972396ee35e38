"""The `flashbench` command: a thin layer over the Python API, one module per command."""

import sys
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.markup import escape

from ..errors import FlashbenchError

# Not a terminal (a log, CI): wide enough that result tables stay on one line per row.
console = Console() if sys.stdout.isatty() else Console(width=160)
errors = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
INTERRUPTED = 130  # a shell's exit code for a command ended by Ctrl-C (128 + SIGINT)


class Group(click.Group):
    """Prints a FlashbenchError, or a command's flags that do not fit, as one line (no traceback, no
    usage block) and exits 2; Ctrl-C exits 130, as a shell's commands do (click's own handling would
    exit 1, which reads as a failed check)."""

    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except click.exceptions.NoArgsIsHelpError:  # a bare `flashbench`: the help, as click shows it
            raise
        except click.UsageError as exc:  # the group's own flags (--root)
            usage_error(exc)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except FlashbenchError as exc:
            fail(escape(str(exc)))
        except click.UsageError as exc:  # a command's flags, parsed here
            usage_error(exc)
        except KeyboardInterrupt:
            errors.print("interrupted", highlight=False)
            sys.exit(INTERRUPTED)


def usage_error(exc: click.UsageError):
    command = exc.ctx.command_path if exc.ctx else "flashbench"  # no context: the group's own flags
    fail(f"{escape(exc.format_message())} See '{command} --help'.")


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


def repo_from(ctx):
    from ..registry import Repo
    return Repo(ctx.obj)


def resolve_device(name: str | None) -> str:
    """A --device checked before any work starts: cpu, cuda or cuda:N of a visible GPU; None: cuda
    when a GPU is visible, else cpu."""
    from ..run import default_device

    if name is None:
        return default_device()
    kind, colon, index = name.partition(":")
    if name == "cpu":
        return name
    if kind != "cuda" or (colon and not index.isdigit()):
        raise FlashbenchError(f"--device {name!r} is not a device flashbench runs on; give cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise FlashbenchError(f"--device {name}: no CUDA device is visible; run with --device cpu, or on a machine with a GPU")
    count = torch.cuda.device_count()
    if colon and int(index) >= count:
        raise FlashbenchError(f"--device {name}: no GPU {index}, {count} visible; give cuda:0 to cuda:{count - 1}")
    return name


from . import calibrate, definitions, interop, leaderboard, run  # noqa: E402,F401  (registers the commands)
