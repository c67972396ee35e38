"""`flashbench import-fib` and `flashbench export-fib`: FlashInfer-Bench datasets in and out."""

from pathlib import Path

import click
from rich.markup import escape

from ..interop import Summary, export_fib, import_fib
from . import console, errors, main, repo_from

# Also accepted after the command name, where people tend to put it.
root_option = click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=None,
                           help="Repository root (the same as flashbench --root).")


def root_of(ctx, root: Path | None) -> Path:
    if root is not None:
        ctx.obj = root
    return repo_from(ctx).root


def report(summary: Summary, verb: str, where: Path) -> None:
    for warning in summary.warnings:
        errors.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)
    console.print(f"{verb} {summary.line()} ({len(summary.warnings)} warning(s)): {escape(str(where))}",
                  highlight=False, soft_wrap=True)


@main.command("import-fib")
@click.argument("dataset", type=click.Path(exists=True, file_okay=False, path_type=Path))
@root_option
@click.pass_context
def import_command(ctx, dataset, root):
    """Bring a FlashInfer-Bench dataset (definitions, workloads, solutions, traces) into the repository."""
    root = root_of(ctx, root)
    report(import_fib(dataset, root), "imported", root)


@main.command("export-fib")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@root_option
@click.pass_context
def export_command(ctx, out_dir, root):
    """Write the repository in FlashInfer-Bench's dataset layout under OUT_DIR."""
    report(export_fib(root_of(ctx, root), out_dir), "exported", out_dir)
