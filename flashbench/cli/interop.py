"""`flashbench import-fib` and `flashbench export-fib`: FlashInfer-Bench datasets in and out."""

from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from ..interop import Summary, export_fib, import_fib
from ..registry import use_root
from ..traces import TIMING_METHODS
from . import console, errors, main, repo_from

# Also accepted after the command name, where people tend to put it.
root_option = click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=None,
                           help="Repository root (the same as flashbench --root).")
json_option = click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON document instead.")
OUTCOME_STYLE = {"failed": "bold red", "skipped": "yellow", "ignored": "dim"}


def root_of(ctx, root: Path | None) -> Path:
    if root is not None:
        ctx.obj = root
        use_root(root)
    return repo_from(ctx).root


def report(summary: Summary, verb: str, where: Path, as_json: bool) -> None:
    if as_json:
        click.echo(summary.model_dump_json(indent=2))
        return
    table = Table("definition", "kind", "outcome", "count", "why", title=f"{verb} {where}", title_justify="left")
    for row in summary.table_rows():
        style = OUTCOME_STYLE.get(row.outcome, "")
        outcome = f"[{style}]{row.outcome}[/]" if style else row.outcome
        table.add_row(escape(row.definition or "(dataset)"), row.kind, outcome, str(row.count), escape(row.why))
    console.print(table)
    console.print(escape(summary.line(verb)), highlight=False, soft_wrap=True)


@main.command("import-fib")
@click.argument("dataset", type=click.Path(exists=True, file_okay=False, path_type=Path))
@root_option
@click.option("--source", default=None,
              help="The board source its traces go to, traces/imported/SOURCE/ (default: the dataset folder's name).")
@json_option
@click.pass_context
def import_command(ctx, dataset, root, source, as_json):
    """Bring a FlashInfer-Bench dataset (definitions, workloads, solutions, traces) into the repository.

    Each definition comes in whole or not at all. Traces go to traces/imported/SOURCE/, a board source
    of their own (`flashbench leaderboard --trace-dir traces/imported/SOURCE`).

    \b
    Exit codes:
      0    every definition imported (records flashbench cannot use are skipped, with the reason)
      1    a definition failed: nothing of it was written (the summary says why)
      2    bad input: not a dataset, not a repository
    """
    root = root_of(ctx, root)
    summary = import_fib(dataset, root, source)
    report(summary, "imported", root, as_json)
    if summary.failed:
        errors.print(f"{len(summary.failed)} definition(s) not imported (exit 1)", highlight=False)
        ctx.exit(1)


@main.command("export-fib")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@root_option
@click.option("--timing", type=click.Choice(TIMING_METHODS), default="events", show_default=True,
              help="Which traces to export: FIB's traces do not say how they were timed, so an export holds one method.")
@click.option("--index-blobs", is_flag=True,
              help="Write generated index tensors as safetensors blobs, so that FIB's own runner can use the workloads "
                   "(hundreds of MB; without it they are FIB random inputs, which only flashbench remakes exactly).")
@json_option
@click.pass_context
def export_command(ctx, out_dir, root, timing, index_blobs, as_json):
    """Write the repository in FlashInfer-Bench's dataset layout under OUT_DIR (new or empty).

    The result loads with FIB's TraceSet.from_path; what FIB has no field for travels in `flashbench`
    extension fields and flashbench.json, so import-fib gives the repository back."""
    summary = export_fib(root_of(ctx, root), out_dir, timing, index_blobs=index_blobs)
    report(summary, "exported", out_dir, as_json)
