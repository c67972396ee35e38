"""`flashbench leaderboard`, `compare` and `report`: reading recorded traces."""

import contextlib
import io
import os
import stat
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..errors import FlashbenchError
from ..model.trace import printable_line
from ..traces import TIMING_METHODS
from . import console, errors, main, repo_from

FORMATS = ["table", "markdown", "csv", "json", "html"]
TIMING_OPTION = click.option(
    "--timing", type=click.Choice(TIMING_METHODS), default="events", show_default=True,
    help="Which recorded timings: CUDA events (<def>.jsonl) or CUDA-graph replay (<def>.graph.jsonl).")


def trace_options(func):
    options = [
        click.option("--def", "definition", required=True, help="Definition name or unique prefix."),
        click.option("--hardware", default=None, help="Hardware name or its folder under traces/ (default: every folder)."),
        click.option("--trace-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                     help="Default: traces/ in the repo."),
        TIMING_OPTION,
    ]
    for option in reversed(options):
        func = option(func)
    return func


def rich_table(frame, title: str | None = None) -> Table:
    """`frame` as a terminal table whose every header and cell is text: names and messages come from trace
    files, and as rich markup "[/x]" ended the command and "[link=...]" hid a link; escape sequences are
    shown as '?' (printable_line)."""
    table = Table(title=title, title_justify="left")
    for column in frame.columns:
        table.add_column(Text(printable_line(str(column))))
    for row in frame.itertuples(index=False):
        table.add_row(*(Text("" if value is None else printable_line(str(value))) for value in row))
    return table


def write_text(text: str, out: Path | None) -> None:
    if out:
        with output_file(out) as handle:
            handle.write(text)
    else:
        click.echo(text, nl=False)


@contextlib.contextmanager
def output_file(out: Path):
    """`out` to write, never a file boards read (`report --out` onto the trace file it read replaced every record
    with Markdown). A plain file (or none yet) is written whole or not at all, through a temporary file beside it
    that takes its mode; anything else (a terminal, a pipe, /dev/stdout, a link) is written as it is."""
    from ..build import write_whole
    from ..run.recorder import read_by_boards

    if read_by_boards(out) or read_by_boards(Path(os.path.realpath(out))):
        raise FlashbenchError("--out may not name a trace file or a calibration (*.jsonl, calibration.json): "
                              "boards read those", out)
    try:
        found = os.lstat(out)
    except FileNotFoundError:
        found = None
    except OSError as exc:
        raise FlashbenchError(f"cannot write: {exc.strerror}", out) from None
    try:
        if found is not None and not stat.S_ISREG(found.st_mode):
            with open(out, "w") as handle:
                yield handle
        else:
            text = io.StringIO()
            yield text
            write_whole(out, text.getvalue().encode(), stat.S_IMODE(found.st_mode) if found else 0o666 & ~_umask())
    except OSError as exc:
        raise FlashbenchError(f"cannot write: {exc.strerror}", out) from None
    # on stderr when the output is no file (/dev/stdout: the notice would end a JSON document)
    (console if found is None or stat.S_ISREG(found.st_mode) else errors).print(f"wrote {out}", highlight=False)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@main.command()
@trace_options
@click.option("--baseline", default=None, help="Solution the others are measured against "
              "(default: the fastest repository solution tagged 'baseline', as its folder holds it now; else the "
              "reference).")
@click.option("--by-workload", is_flag=True, help="Per workload: best solution and every solution's latency.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write here instead of stdout.")
@click.option("--charts", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Also write latency and roofline PNGs per hardware into this folder.")
@click.option("--include-smoke", is_flag=True, help="Count the latencies of workloads tagged smoke in the speedups, "
              "fast_p, win rate and % SOL (by default they count in passed/total only).")
@click.option("--hide-stale", is_flag=True, help="Leave out results whose solution folder has changed since.")
@click.option("--isolation", type=click.Choice(["namespaces", "process"]), default=None,
              help="Only results whose worker ran at this isolation level (default: all).")
@click.pass_context
def leaderboard(ctx, definition, hardware, trace_dir, timing, baseline, by_workload, fmt, out, charts, include_smoke,
                hide_stale, isolation):
    """Rank solutions per hardware from recorded traces (see `flashbench.leaderboard` for the rules)."""
    from .. import leaderboard as lb
    from ..leaderboard import formats

    repo = repo_from(ctx)
    name = repo.resolve(definition)
    boards = _boards(repo, name, hardware, trace_dir, timing, baseline, include_smoke, hide_stale, isolation)
    if charts:
        colours = lb.board_colours(boards)
        for board in boards:
            for path in lb.save_charts(board, charts, colours):
                console.print(f"wrote {path}", highlight=False)
    if fmt == "table":
        with output_file(out) if out else contextlib.nullcontext() as handle:
            target = Console(file=handle, width=160) if out else console
            for board in boards:
                shown = lb.by_workload_display(board) if by_workload else lb.ranking_display(board)
                target.print(rich_table(shown, title=formats.board_title(board)))
                for note in board.notes:  # they name solutions and what their traces say of the device
                    target.print(f"  {printable_line(note)}", markup=False, highlight=False)
        return
    text = {"markdown": lambda: f"# {name}\n\n" + formats.markdown(boards, by_workload),
            "csv": lambda: formats.csv(boards, by_workload), "json": lambda: formats.json_text(boards),
            "html": lambda: lb.html_page(boards, name)}[fmt]()
    write_text(text, out)


@main.command()
@click.argument("a")
@click.argument("b")
@trace_options
@click.pass_context
def compare(ctx, a, b, definition, hardware, trace_dir, timing):
    """Per workload, is B faster, slower or the same as A (by the 95% intervals of the medians)?"""
    from .. import leaderboard as lb

    repo = repo_from(ctx)
    name = repo.resolve(definition)
    workload_set = repo.workload_set(name)
    comparisons = lb.compare(trace_dir or repo.root / "traces", name, a, b,
                             workload_set.workloads if workload_set else None, hardware, timing)
    for comparison in comparisons:
        console.print(rich_table(lb.comparison_display(comparison), title=f"{comparison.hardware_name}: {b} against {a}"))
        console.print(comparison.summary, markup=False, highlight=False)


@main.command()
@click.option("--def", "definition", required=True, help="Definition name or unique prefix.")
@click.option("--hardware", default=None,
              help="Hardware name or its folder under traces/, e.g. nvidia_h200 (default: the one with traces of it).")
@click.option("--trace-dir", type=click.Path(file_okay=False, path_type=Path), default=None, help="Default: traces/ in the repo.")
@TIMING_OPTION
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the Markdown here.")
@click.pass_context
def report(ctx, definition, hardware, trace_dir, timing, out):
    """A Markdown benchmark table from recorded traces: per workload the floor and each solution's
    latency ± spread, share of the floor and achieved TFLOP/s or GB/s; how it was measured above it."""
    from ..calibrate import load_calibration
    from ..leaderboard import belonging, markdown_report, report_board, solution_hashes
    from ..traces import trace_file_name, trace_path

    repo = repo_from(ctx)
    name = repo.resolve(definition)
    trace_dir = trace_dir or repo.root / "traces"
    if hardware is None:  # as leaderboard and compare need none: the one folder with traces of the definition
        found = sorted(path.parent.name for path in trace_dir.glob(f"*/{trace_file_name(name, timing)}"))
        if len(found) != 1:
            raise FlashbenchError(f"traces of {name} for {len(found)} hardware here"
                                  + (f" ({', '.join(found)}): pick one with --hardware" if found else ""), trace_dir)
        hardware = found[0]
    path = trace_path(trace_dir, hardware, name, timing)
    traces = belonging(path, name)  # as on the boards: a record of another definition stays off
    if not traces:
        raise FlashbenchError("no traces recorded here", path)
    board = report_board(traces, repo.workload_set(name).workloads, hardware, load_calibration(trace_dir, hardware),
                         solution_hashes(repo, name))
    if board is None:
        raise FlashbenchError(f"no traces of {hardware} on workloads of the workload set", path)
    shown = path.relative_to(repo.root) if path.is_relative_to(repo.root) else path
    # The board's own name: the file's first record may be another hardware's, left off the board
    title = f"{name} on {board.hardware_name}" + (", CUDA-graph replay" if timing == "graph" else "")
    write_text(markdown_report(title, board, shown), out)


def _boards(repo, name, hardware, trace_dir, timing, baseline, include_smoke, hide_stale, isolation=None):
    from ..leaderboard import leaderboards, solution_hashes
    from ..traces import trace_file_name, trace_path

    trace_dir = trace_dir or repo.root / "traces"
    workload_set = repo.workload_set(name)
    boards = leaderboards(trace_dir, name, workload_set.workloads if workload_set else None, hardware, baseline, timing,
                          include_smoke=include_smoke, current_hashes=solution_hashes(repo, name), hide_stale=hide_stale,
                          isolation=isolation)
    if not boards:
        where = trace_path(trace_dir, hardware, name, timing) if hardware else Path(trace_dir) / "*" / trace_file_name(name, timing)
        raise FlashbenchError("no traces recorded here", where)
    return boards
