"""`flashbench run` and `flashbench submit`."""

import contextlib
import os
import shlex
import sys
import time
from pathlib import Path

import click
from click.core import ParameterSource
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text
from rich.table import Table

from ..api import run_options, run_report
from ..errors import FlashbenchError
from ..model.run_report import HOST_CLOCK
from ..registry import load_solution_folder
from ..traces import TIMING_METHODS
from ..run import (RunOptions, RunResult, Runner, device_threads_left, install_solution, installed_path, sandbox,
                   select_solutions, select_workloads)
from ..run.recipe import DEFAULT_FLUSH, FLUSH_METHODS
from . import INTERRUPTED, console, errors, main, repo_from, shown

STATUS_STYLE = {"PASSED": "green", "MISSING_DEPENDENCY": "yellow"}
NOT_APPLICABLE = "—"  # a figure that means nothing here (a rate from a host clock): never a 0


def device_label(options: RunOptions) -> str:
    if options.backend == "ray":
        return f"Ray ({'GPUs' if options.device.startswith('cuda') else 'CPUs'})"
    devices = options.devices or [options.device]
    return devices[0] if len(devices) == 1 else f"{len(devices)} devices ({', '.join(devices)})"


def execute(repo, definition_name, folders, workloads, options) -> tuple[RunResult, bool]:
    """Every pair, then the summary; on Ctrl-C, the summary of the pairs that finished before it, and True."""
    finished = []

    def on_result(trace):
        finished.append(trace)
        # A log file (not a terminal) gets a line per finished job: a long run written to a file shows where it is.
        if not console.is_terminal:
            print_trace_line(trace)

    runner = Runner(repo, definition_name, options, on_result=on_result)
    candidates = runner.candidates(folders)
    try:
        # What is running now comes first: on a narrow terminal the bar is what gets squeezed.
        with Progress(TextColumn("{task.fields[doing]}"), PhaseClock(), BarColumn(bar_width=20), MofNCompleteColumn(),
                      TimeElapsedColumn(), TextColumn("{task.description}"), console=console, transient=True) as progress:
            task = progress.add_task(f"on {device_label(options)}", total=len(candidates) * len(workloads),
                                     doing="", since=None)

            def on_phase(job, phase):
                progress.update(task, doing=f"{job.candidate.solution.name} · {workload_label(job.workload)} · {phase}",
                                since=time.monotonic())
                if phase == "build" and not console.is_terminal:  # a log file shows why nothing ends for a while
                    console.print(f"{job.candidate.solution.name}: building", highlight=False)

            result = runner.run(candidates, workloads, advance=lambda: progress.advance(task), on_phase=on_phase)
            interrupted = False
    except KeyboardInterrupt:
        result, interrupted = RunResult(traces=finished, trace_file=runner.trace_file), True
    if result.traces:
        print_summary(result.traces)
        print_failure_logs(result.traces)
    if result.isolation:
        confined = "" if sandbox.confines_writes() else "; this kernel has no Landlock: their writes are not confined"
        who = f", {result.workers_as}" if result.workers_as else ""
        console.print(f"workers isolated at level {result.isolation}{who}{confined} (docs/threat_model.md)",
                      highlight=False)
    if result.skipped:
        failed = sum(t.status != "PASSED" for t in result.skipped)
        console.print(f"{len(result.skipped)} pair(s) already recorded were skipped (--resume)"
                      + (f", {failed} of them not PASSED" if failed else ""), highlight=False)
    if options.save:
        console.print(f"traces: {result.trace_file}", highlight=False)
    return result, interrupted


class PhaseClock(ProgressColumn):
    """How long the current phase has lasted: a long build or reference shows it is not a hang."""

    def render(self, task) -> Text:
        since = task.fields.get("since")
        return Text("" if since is None else f"{time.monotonic() - since:.0f} s", style="progress.elapsed")


def workload_label(workload) -> str:
    return workload.name or workload.uuid[:8]


def print_trace_line(trace) -> None:
    perf = trace.performance
    latency = f" {perf.latency_ms * 1e3:.1f} µs" if perf else ""
    message = f" {trace.message[:120]}" if trace.message and trace.status != "PASSED" else ""
    console.print(f"{trace.solution} {trace.workload_name or trace.workload[:8]} {trace.status}{latency}{escape(message)}",
                  highlight=False)


def print_summary(traces) -> None:
    table = Table("solution", "workload", "status", "latency", "p10–p90 µs", "speedup", "achieved", "timing",
                  title="results")
    for trace in traces:
        perf = trace.performance
        status = f"[{STATUS_STYLE.get(trace.status, 'red')}]{trace.status}[/]"
        if trace.message and trace.status != "PASSED":
            status += f" {escape(trace.message[:80])}"
        measured = ["", "", "", "", ""]
        if perf:
            measured = [f"{perf.latency_ms * 1e3:.1f} µs", f"{perf.p10_ms * 1e3:.1f}–{perf.p90_ms * 1e3:.1f}",
                        f"{perf.speedup:.2f}x" if perf.speedup else NOT_APPLICABLE, achieved(perf),
                        perf.timing.get("method", "")]
        table.add_row(trace.solution, trace.workload_name or trace.workload[:8], status, *measured)
    console.print(table)


LOG_LINES = 12  # of a failed pair's log, printed under the summary: a traceback's last frames and its error


def print_failure_logs(traces) -> None:
    """The end of each failing solution's first log (its traceback, what it printed): the message alone is one line."""
    shown_for = set()
    for trace in traces:
        if trace.status == "PASSED" or not trace.log.strip() or trace.solution in shown_for:
            continue
        shown_for.add(trace.solution)
        lines = trace.log.rstrip().splitlines()[-LOG_LINES:]
        console.print(f"log of {trace.solution} on {trace.workload_name or trace.workload[:8]} ({trace.status}), "
                      f"last {len(lines)} lines (all in the trace's log):", highlight=False)
        console.print("\n".join(f"  {line}" for line in lines), markup=False, highlight=False)


def achieved(perf) -> str:
    """GB/s and TFLOP/s from the cost model; none from a CPU's host clock, where a rate means nothing."""
    if perf.timing.get("method") == HOST_CLOCK or not (perf.bytes or perf.flops):
        return NOT_APPLICABLE
    seconds = perf.latency_ms / 1e3
    parts = []
    if perf.bytes:
        parts.append(f"{rate(perf.bytes / seconds / 1e9)} GB/s")
    if perf.flops:
        parts.append(f"{rate(perf.flops / seconds / 1e12)} TFLOP/s")
    return ", ".join(parts)


def rate(value: float) -> str:
    """Whole numbers from 10 up; two significant digits below, so a small rate never reads as 0."""
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def human_output(as_json: bool):
    """With --json, stdout carries the one document: what is meant for people (progress, tables, and
    any stray print) goes to stderr instead."""
    return contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()


def given_arguments(ctx: click.Context) -> list[str]:
    """The options a command line gave this context, as words of a command line."""
    words = []
    for param in ctx.command.params:
        if ctx.get_parameter_source(param.name) is not ParameterSource.COMMANDLINE:
            continue
        value = ctx.params[param.name]
        if param.is_flag:
            words.append(param.opts[0])
        else:
            for one in value if param.multiple else [value]:
                words += [param.opts[0], str(one)]
    return words


def resume_command(ctx: click.Context) -> str:
    """The command line that continues an interrupted run: the one given, with --resume."""
    words = ["flashbench", *given_arguments(ctx.parent), ctx.info_name, *given_arguments(ctx)]
    return shlex.join(words if "--resume" in words else words + ["--resume"])


def stop_interrupted(ctx: click.Context, finished: int, next_step: str) -> None:
    errors.print(f"interrupted after {finished} finished pair(s); {next_step}", highlight=False, soft_wrap=True)
    if device_threads_left():
        # The interpreter's shutdown under a thread still in PyTorch's CUDA code can abort ("terminate called
        # without an active exception", exit 134 after the summary, seen on an H100). Every trace is written
        # and closed as its pair ends, and everything is printed: the process leaves without that shutdown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(INTERRUPTED)
    ctx.exit(INTERRUPTED)


def timing_options(func):
    options = [
        click.option("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when present, else cpu)."),
        click.option("--warmup", type=click.IntRange(0), default=None, help="Untimed calls first (default 10 on GPU, 1 on CPU)."),
        click.option("--iters", type=click.IntRange(1), default=None, help="Timed calls per job: at least this many (default 100 on GPU, 5 on CPU) while they fit in 2 s."),
        click.option("--seed", type=int, default=None,
                     help="Seed of the first input set, for a run others can repeat (default: seeds drawn afresh, "
                          "unknown to any solution; traces say which)."),
        click.option("--flush", type=click.Choice(list(FLUSH_METHODS)), default=DEFAULT_FLUSH, show_default=True,
                     help="How the L2 is flushed before each timed call (none: a warm L2); recorded in every trace."),
        click.option("--checked-calls", type=click.IntRange(0), default=None,
                     help="Timed calls checked per pair, picked after they ran (default: all on a CPU, 8 on a GPU; "
                          "a sampling definition's pairs check at least 512 samples)."),
        click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds for a build or a workload before the worker is killed."),
        click.option("--timing", type=click.Choice(TIMING_METHODS), default="events", show_default=True,
                     help="events: CUDA events per call; graph: CUDA-graph replay, free of launch overhead."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


json_option = click.option(
    "--json", "as_json", is_flag=True,
    help="Print one JSON document on stdout (format flashbench.run/1, described in the README); "
         "progress and tables go to stderr.")


@main.command()
@click.option("--def", "definition", required=True, help="Definition name or unique prefix.")
@click.option("--solution", "solutions", multiple=True, help="Solution name, folder, or FlashInfer-Bench solution JSON (repeatable; default: all; 'reference' alone: only the reference).")
@click.option("--workload", "workloads", multiple=True, help="Workload uuid, name or tag (repeatable; default: all, or 'smoke' on CPU).")
@timing_options
@click.option("--devices", default=None,
              help="Spread the jobs over devices, one job per device at a time: all (every GPU), 0,1,... or "
                   "cuda:N,..., or cpu:N for N CPU devices (for trying the pool without a GPU).")
@click.option("--backend", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="local: worker processes on this machine; ray: one Ray task per job, each holding a GPU.")
@click.option("--address", default=None, help="With --backend ray: the cluster to join (default: a local Ray instance).")
@click.option("--resume", is_flag=True,
              help="Skip pairs already recorded for the same solution content and hardware (outcomes of a missing "
                   "package, GPU or compiler run again, and so do records of another version of the judge, made "
                   "less isolated, after another L2 flush, on public seeds or with other call counts, timeouts "
                   "under a shorter --timeout, and pairs rejected because the trace file changed).")
@click.option("--no-save", is_flag=True, help="Do not write traces.")
@click.option("--trace-dir", type=click.Path(file_okay=False, path_type=Path), default=None, help="Default: traces/ in the repo.")
@click.option("--allow-fail", is_flag=True,
              help="Exit 0 even when a pair did not pass (its status is shown and recorded all the same).")
@json_option
@click.pass_context
def run(ctx, definition, solutions, workloads, device, warmup, iters, seed, flush, checked_calls, timeout, timing,
        devices, backend, address, resume, no_save, trace_dir, allow_fail, as_json):
    """Check and time solutions of a definition on its workloads; record traces.

    \b
    Exit codes:
      0    every pair passed (or --allow-fail)
      1    a pair did not pass: any status but PASSED, MISSING_DEPENDENCY included; with
           --resume, pairs recorded before and skipped count with their recorded status; or, with
           no --solution, a folder under solutions/ was invalid (skipped, the others ran)
      2    bad input: unknown definition, solution or workload, flags that do not fit, no such device
      130  interrupted (Ctrl-C or SIGTERM): what finished is summarised, with the command that continues
           (--resume)
    """
    repo = repo_from(ctx)
    name = repo.resolve(definition)
    options = run_options(device, warmup, iters, seed, timeout, timing, resume, not no_save, trace_dir,
                          devices, backend, address, flush, checked_calls)
    folders = select_solutions(repo, name, list(solutions), options.cache_dir)
    chosen = select_workloads(repo, name, list(workloads), options.device)
    invalid = [] if solutions else repo.invalid_solution_folders(name)  # all of them: the others still run
    for problem in invalid:
        errors.print(f"skipped an invalid solution folder: {shown(problem)}", highlight=False)
    with human_output(as_json):
        result, interrupted = execute(repo, name, folders, chosen, options)
    if as_json:
        click.echo(run_report("run", repo, name, options, result, interrupted).model_dump_json(indent=2))
    if interrupted:
        stop_interrupted(ctx, len(result.traces), f"continue with: {resume_command(ctx)}" if options.save
                         else "nothing was saved (--no-save)")
    # A resumed run answers for the pairs it skipped too: their recorded outcome is this run's.
    pairs = [*result.skipped, *result.traces]
    failed = [t for t in pairs if t.status != "PASSED"]
    if (failed or invalid) and not allow_fail:
        earlier = sum(t.status != "PASSED" for t in result.skipped)
        errors.print(f"{len(failed)} of {len(pairs)} pair(s) did not pass"
                     + (f" ({earlier} recorded before this run, --resume)" if earlier else "")
                     + (f"; {len(invalid)} invalid solution folder(s) skipped" if invalid else "")
                     + " (exit 1; --allow-fail exits 0)", highlight=False)
        ctx.exit(1)


@main.command()
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
@timing_options
@click.option("--trace-dir", type=click.Path(file_okay=False, path_type=Path), default=None, help="Default: traces/ in the repo.")
@json_option
@click.pass_context
def submit(ctx, path, device, warmup, iters, seed, flush, checked_calls, timeout, timing, trace_dir, as_json):
    """Validate a solution folder, run it on the smoke workloads (recording traces as run does), and copy
    it into solutions/ if it passed on every one.

    \b
    Exit codes:
      0    submitted
      1    not submitted: the solution did not pass a workload
      2    bad input: an invalid folder, an unknown definition, no such device
      130  interrupted (Ctrl-C or SIGTERM): nothing is submitted
    """
    from ..validate import validate

    options = run_options(device, warmup, iters, seed, timeout, timing, False, True, trace_dir,
                          flush=flush, checked_calls=checked_calls)
    repo = repo_from(ctx)
    problems = [error for c in validate(repo, [path.resolve()]) for error in c.errors]
    if problems:
        raise FlashbenchError(problems[0])
    folder = load_solution_folder(path.resolve())
    name = repo.resolve(folder.solution.definition)
    with human_output(as_json):
        result, interrupted = execute(repo, name, [folder], select_workloads(repo, name, ["smoke"], options.device), options)
        failed = [t for t in result.traces if t.solution == folder.solution.name and t.status != "PASSED"]
        submitted_to = None
        if not (interrupted or failed):
            ran_hash = next((t.solution_hash for t in result.traces if t.solution == folder.solution.name), None)
            held = installed_path(repo, folder).exists()
            submitted_to = install_solution(repo, path.resolve(), ran_hash).relative_to(repo.root)
            console.print(f"already in the repository with the same code, left as it is: {submitted_to}" if held
                          else f"submitted to {submitted_to}", highlight=False)
    if as_json:
        click.echo(run_report("submit", repo, name, options, result, interrupted,
                              str(submitted_to) if submitted_to else None).model_dump_json(indent=2))
    if interrupted:
        stop_interrupted(ctx, len(result.traces), "nothing was submitted")
    if failed:
        first = failed[0]
        reason = first.message.partition("\n")[0]  # one line, however long the build log
        errors.print(f"{shown(path)}: not submitted: {first.status} on {first.workload_name}: {shown(reason)}",
                     highlight=False, soft_wrap=True)
        ctx.exit(1)
