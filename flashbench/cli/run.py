"""`flashbench run` and `flashbench submit`."""

from pathlib import Path

import click
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..errors import FlashbenchError
from ..registry import load_solution_folder
from ..traces import TIMING_METHODS
from ..run import RunOptions, Runner, default_device, install_solution, parse_devices, select_solutions, select_workloads
from ..run.recipe import DEFAULT_FLUSH, FLUSH_METHODS
from . import console, main, repo_from

STATUS_STYLE = {"PASSED": "green", "MISSING_DEPENDENCY": "yellow"}


def run_options(device, warmup, iters, seed, timeout, timing, resume, save, trace_dir,
                devices=None, backend="local", address=None, flush=DEFAULT_FLUSH, checked_calls=None) -> RunOptions:
    pool = device_pool(device, devices, backend, address)
    device = pool[0] if pool else device or default_device()
    on_cpu = device == "cpu"
    return RunOptions(
        device=device, devices=pool, backend=backend, ray_address=address,
        warmup=warmup if warmup is not None else (1 if on_cpu else 10),
        iters=iters if iters is not None else (5 if on_cpu else 100), seed=seed, timeout=timeout,
        timing=timing, resume=resume, save=save, trace_dir=trace_dir, flush=flush, checked_calls=checked_calls,
    )


def device_pool(device, devices, backend, address) -> list[str] | None:
    if address and backend != "ray":
        raise FlashbenchError("--address is for --backend ray")
    if devices is None:
        return None
    if device:
        raise FlashbenchError("give --device or --devices, not both")
    if backend == "ray":
        raise FlashbenchError("--devices is for the local backend; Ray gives every job a device of its own")
    return parse_devices(devices)


def device_label(options: RunOptions) -> str:
    if options.backend == "ray":
        return f"Ray ({'GPUs' if options.device.startswith('cuda') else 'CPUs'})"
    devices = options.devices or [options.device]
    return devices[0] if len(devices) == 1 else f"{len(devices)} devices ({', '.join(devices)})"


def execute(repo, definition_name, folders, workloads, options) -> list:
    # A terminal shows a progress bar; a log file gets a line per finished job instead, so a long
    # run written to a file shows where it is.
    runner = Runner(repo, definition_name, options, on_result=(lambda trace: None) if console.is_terminal else print_trace_line)
    candidates = runner.candidates(folders)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task(f"{runner.definition.name} on {device_label(options)}", total=len(candidates) * len(workloads))
        result = runner.run(candidates, workloads, advance=lambda: progress.advance(task))
    print_summary(result.traces)
    console.print(f"workers isolated at level {result.isolation} (docs/threat_model.md)", highlight=False)
    if result.skipped:
        console.print(f"{result.skipped} pair(s) already recorded were skipped (--resume)")
    if options.save:
        console.print(f"traces: {result.trace_file}", highlight=False)
    return result.traces


def print_trace_line(trace) -> None:
    perf = trace.performance
    latency = f" {perf.latency_ms * 1e3:.1f} µs" if perf else ""
    message = f" {trace.message[:120]}" if trace.message and trace.status != "PASSED" else ""
    console.print(f"{trace.solution} {trace.workload_name or trace.workload[:8]} {trace.status}{latency}{escape(message)}",
                  highlight=False)


def print_summary(traces) -> None:
    table = Table("solution", "workload", "status", "latency", "speedup", "achieved", title="results")
    for trace in traces:
        perf = trace.performance
        style = STATUS_STYLE.get(trace.status, "red")
        latency = f"{perf.latency_ms * 1e3:.1f} µs" if perf else ""
        speedup = f"{perf.speedup:.2f}x" if perf and perf.speedup else ""
        achieved = _achieved(perf) if perf else ""
        status = f"[{style}]{trace.status}[/]"
        if trace.message and trace.status != "PASSED":
            status += f" {escape(trace.message[:80])}"
        table.add_row(trace.solution, trace.workload_name or trace.workload[:8], status, latency, speedup, achieved)
    console.print(table)


def _achieved(perf) -> str:
    seconds = perf.latency_ms / 1e3
    parts = []
    if perf.bytes:
        parts.append(f"{perf.bytes / seconds / 1e9:.0f} GB/s")
    if perf.flops:
        parts.append(f"{perf.flops / seconds / 1e12:.1f} TFLOP/s")
    return ", ".join(parts)


def timing_options(func):
    options = [
        click.option("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when present, else cpu)."),
        click.option("--warmup", type=click.IntRange(0), default=None, help="Untimed calls first (default 10 on GPU, 1 on CPU)."),
        click.option("--iters", type=click.IntRange(1), default=None, help="Timed calls (default 100 on GPU, 5 on CPU)."),
        click.option("--seed", type=int, default=None,
                     help="Seed of the first input set, for a run others can repeat (default: seeds drawn afresh, "
                          "unknown to any solution; traces say which)."),
        click.option("--flush", type=click.Choice(list(FLUSH_METHODS)), default=DEFAULT_FLUSH, show_default=True,
                     help="How the L2 is flushed before each timed call (none: a warm L2); recorded in every trace."),
        click.option("--checked-calls", type=click.IntRange(0), default=None,
                     help="Timed calls checked per pair, picked after they ran (default: all on a CPU, 8 on a GPU)."),
        click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds for a build or a workload before the worker is killed."),
        click.option("--timing", type=click.Choice(TIMING_METHODS), default="events", show_default=True,
                     help="events: CUDA events per call; graph: CUDA-graph replay, free of launch overhead."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


@main.command()
@click.option("--def", "definition", required=True, help="Definition name or unique prefix.")
@click.option("--solution", "solutions", multiple=True, help="Solution name or folder (repeatable; default: all; 'reference' alone: only the reference).")
@click.option("--workload", "workloads", multiple=True, help="Workload uuid, name or tag (repeatable; default: all, or 'smoke' on CPU).")
@timing_options
@click.option("--devices", default=None,
              help="Spread the jobs over devices, one job per device at a time: all (every GPU), 0,1,... or "
                   "cuda:N,..., or cpu:N for N CPU devices (for trying the pool without a GPU).")
@click.option("--backend", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="local: worker processes on this machine; ray: one Ray task per job, each holding a GPU.")
@click.option("--address", default=None, help="With --backend ray: the cluster to join (default: a local Ray instance).")
@click.option("--resume", is_flag=True, help="Skip pairs already recorded for the same solution content and hardware.")
@click.option("--no-save", is_flag=True, help="Do not write traces.")
@click.option("--trace-dir", type=click.Path(file_okay=False, path_type=Path), default=None, help="Default: traces/ in the repo.")
@click.pass_context
def run(ctx, definition, solutions, workloads, device, warmup, iters, seed, flush, checked_calls, timeout, timing,
        devices, backend, address, resume, no_save, trace_dir):
    """Check and time solutions of a definition on its workloads; record traces."""
    repo = repo_from(ctx)
    name = repo.resolve(definition)
    options = run_options(device, warmup, iters, seed, timeout, timing, resume, not no_save, trace_dir,
                          devices, backend, address, flush, checked_calls)
    execute(repo, name, select_solutions(repo, name, list(solutions)), select_workloads(repo, name, list(workloads), options.device), options)


@main.command()
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
@timing_options
@click.pass_context
def submit(ctx, path, device, warmup, iters, seed, flush, checked_calls, timeout, timing):
    """Validate a solution folder, run it on the smoke workloads, and copy it into solutions/."""
    from ..validate import validate

    repo = repo_from(ctx)
    problems = [c.error for c in validate(repo, [path.resolve()]) if not c.ok]
    if problems:
        raise FlashbenchError(problems[0])
    folder = load_solution_folder(path.resolve())
    name = repo.resolve(folder.solution.definition)
    options = run_options(device, warmup, iters, seed, timeout, timing, False, False, None,
                          flush=flush, checked_calls=checked_calls)
    traces = execute(repo, name, [folder], select_workloads(repo, name, ["smoke"], options.device), options)
    failed = [t for t in traces if t.solution == folder.solution.name and t.status != "PASSED"]
    if failed:
        raise FlashbenchError(f"not submitted: {failed[0].status} on {failed[0].workload_name}: {failed[0].message}", path)
    console.print(f"submitted to {install_solution(repo, path.resolve()).relative_to(repo.root)}", highlight=False)
