"""Every table in README.md and docs/*.md, made from committed traces and data, and kept so.

A table in Markdown is a generated block: this script writes what lies between the two markers,
and nobody edits it by hand:

    <!-- table: NAME ARGS -->
    ...
    <!-- /table -->

    python benchmarks/evidence_tables.py --write      # regenerate every block in README.md and docs/*.md
    python benchmarks/evidence_tables.py --check      # exit 1 naming each out-of-date or failing block, else 0
    python benchmarks/evidence_tables.py NAME ARGS    # print one table

A table starts with a line naming its source files, the device they record and the command that
made it. Paths are relative to the repository root; a missing input is a one-line error naming it.

    flush [FILE]                    L2 flush methods (benchmarks/l2_flush.py --json); FILE defaults to
                                    docs/data/l2_flush_h200.json
    clocks [FILE EARLIER]           judge's clock and worker's events (FILE, default
                                    docs/data/decode_clocks_h200.jsonl) against an earlier events trace file
                                    (default docs/data/boards_before_judge/mla_paged_decode_h16_ckv512_kpe64_ps1.jsonl)
    adversarial [FILE]              fixtures of the adversarial corpus (default docs/data/adversarial_gpu_h200.jsonl)
    peers TRACE_FILE                per timed workload, the best peer against our best: PEERS are the solutions
                                    named flashmla and flashinfer_fa3; ours are every solution that is neither a
                                    peer, nor the reference, nor tagged baseline. % of floor is the leaderboard's
                                    own (flashbench.leaderboard.results.with_speed_of_light: the calibrated floor
                                    over the latency), from calibration.json beside TRACE_FILE
    events_graph DEF [SOLUTION...]  per timed workload, each solution's "events µs / graph µs", from
                                    traces/nvidia_h200/<DEF>.jsonl and <DEF>.graph.jsonl (no SOLUTION: every
                                    solution of the events file but the reference)
    repeat FILE_A FILE_B            one definition measured twice: ranked latencies and |difference| per pair
                                    (the solutions under test; not the reference)
    repeat_events FILE_A FILE_B     the same, of the worker's own CUDA-event medians
    steps FILE                      per timed pair of the solutions under test: the judge's clock above the worker's
                                    events and the harness's steps per call it took away, with the readings that
                                    figure was the least of (performance.timing.steps_per_call_ms)
    moved OLD_FILE NEW_FILE         how far each latency moved in a re-recording, and whose content hash changed
    ncu FILE...                     Nsight Compute's text reports of benchmarks/profile_solution.py, one per
                                    file named DEFINITION__SOLUTION__WORKLOAD.txt (globs allowed): per kernel its
                                    time, DRAM and SM throughput, busiest pipeline, launch and occupancy; the
                                    device from nvidia_smi.csv beside the files
    flush_profile FILE              Nsight Compute's DRAM traffic of each decode kernel after each flush
                                    (`ncu ... --csv python benchmarks/l2_flush.py --profile > FILE`)
    keyed_flush FILE                the keyed flush's passes and whole flushes (`python benchmarks/keyed_flush.py
                                    --json FILE`)
    compare FILE                    `benchmarks/flashmla_decode_configs.py compare` log: per workload FlashMLA's
                                    time and the faster of our two kernels as launched by default, old and new
    variants FILE                   any `benchmarks/flashmla_decode_configs.py` log: a column per launch, and our
                                    fastest correct one against FlashMLA (an output off by more than 0.1: wrong)
    rejections FILE_OR_GLOB...      pairs by status for honest solutions (those with a folder under solutions/;
                                    not the reference, not test fixtures), and every REJECTED one

Which record counts: a trace file is appended to, so it may hold several runs of one (solution,
workload). Every table takes the leaderboard's current results (flashbench.leaderboard.results.
current_results): of each solution only its newest content hash, and of that the latest record of
each workload, whatever its status. A re-run replaces the record before it (a rejected cell that
passed when run again shows the pass), a failed re-run is never hidden by an older pass, and an
older hash's records drop out even on workloads the newest has not run (as on the boards). Only
PASSED records with a performance give a latency; an empty cell is "—". Timed workloads are those
the leaderboard times (flashbench.leaderboard.board.is_timed: not tagged smoke in the definition's
workload set); clocks and adversarial list every workload, rejections every pair.
"""

import csv
import glob
import inspect
import json
import math
import re
import statistics
import sys
from functools import cache
from pathlib import Path
from typing import get_args

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout

from flashbench.build import same_content  # noqa: E402
from flashbench.errors import FlashbenchError  # noqa: E402
from flashbench.leaderboard.board import BASELINE_TAG, is_timed  # noqa: E402
from flashbench.leaderboard.results import (current_results, host_bound, solution_hashes, traces_frame,  # noqa: E402
                                           with_speed_of_light)
from flashbench.model import REFERENCE, Calibration, Status, Trace, Workload, load_model  # noqa: E402
from flashbench.registry import Repo  # noqa: E402
from flashbench.traces import TIMING_METHODS, read_traces, trace_path  # noqa: E402

PEERS = ("flashmla", "flashinfer_fa3")
HARDWARE = "nvidia_h200"  # events_graph reads traces/<HARDWARE>/
COMMAND = "python benchmarks/evidence_tables.py"
NONE = "—"
DEFAULTS = {
    "flush": ["docs/data/l2_flush_h200.json"],
    "clocks": ["docs/data/decode_clocks_h200.jsonl",
               "docs/data/boards_before_judge/mla_paged_decode_h16_ckv512_kpe64_ps1.jsonl"],
    "adversarial": ["docs/data/adversarial_gpu_h200.jsonl"],
}
OPEN = re.compile(r"^<!-- table: .*-->$", re.M)
BLOCK = re.compile(r"^<!-- table: (?P<spec>.+?) -->\n(?P<body>.*?)^<!-- /table -->$", re.M | re.S)


# What counts, in every table.

def current(traces: list[Trace]) -> dict[tuple[str, str], Trace]:
    """(solution, workload uuid) -> the record that counts (module docstring), in recorded order."""
    if not traces:
        return {}
    kept = sorted(current_results(traces_frame(traces))["order"])
    return {(traces[i].solution, traces[i].workload): traces[i] for i in kept}


def latency_us(trace: Trace | None) -> float | None:
    if trace is None or trace.status != "PASSED" or trace.performance is None:
        return None
    return trace.performance.latency_ms * 1e3


def timed_pairs(latest: dict, workloads: list[Workload]):
    """(workload, solution, trace) of every record of `latest` on a timed workload, in set order."""
    for workload in timed(workloads, latest):
        for (solution, uuid), trace in latest.items():
            if uuid == workload.uuid:
                yield workload, solution, trace


def timed(workloads: list[Workload], ran: dict) -> list[Workload]:
    """The timed workloads of the set, in set order, that any record of `ran` is of."""
    uuids = {workload for _, workload in ran}
    return [w for w in workloads if is_timed(w) and w.uuid in uuids]


def fastest(latest: dict, workload: str, chosen) -> tuple[str, float] | None:
    """(solution, µs) of the fastest passed solution for which chosen(trace) holds, or None."""
    found = [(latency_us(t), t.solution) for (_, w), t in latest.items() if w == workload and chosen(t)]
    found = [(value, solution) for value, solution in found if value is not None]
    return min(found)[::-1] if found else None


def us(value: float | None) -> str:
    return NONE if value is None else f"{value:.1f}"


def markdown(header: list[str], rows: list[list]) -> str:
    cell = lambda value: str(value).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    line = lambda values: "| " + " | ".join(cell(value) for value in values) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "---|" * len(header), *map(line, rows)])


def spread(changes: list[tuple[float, str]], what: str) -> str:
    """'median |what| x%, max y% (where), over n pairs' of (|change| %, where) pairs."""
    if not changes:
        return "No (solution, workload) pair passed in both."
    top, where = max(changes)
    return (f"Median {what} {statistics.median(c for c, _ in changes):.1f}%, max {top:.1f}% ({where}), "
            f"over {len(changes)} (solution, workload) pairs.")


# The tables: pure functions from data to Markdown.

def flush_table(records: list[dict]) -> str:
    methods = list(dict.fromkeys(r["flush"] for r in records))
    rows = []
    for kernel in dict.fromkeys(r["kernel"] for r in records):
        cells = {r["flush"]: r["median_us"] for r in records if r["kernel"] == kernel}
        rows.append([kernel, *(us(cells.get(m)) for m in methods)])
    return markdown(["kernel", *(f"after {m}" for m in methods)], rows)


def keyed_flush_table(records: list[dict]) -> str:
    """benchmarks/keyed_flush.py's records: a pass or a whole flush, its median time."""
    return markdown(["what", "µs"], [[r["what"], us(r["us"])] for r in records])


def flush_profile_table(order: dict, kernels: list[dict]) -> str:
    """Nsight Compute's readings of each call of `benchmarks/l2_flush.py --profile` (its kernels in launch
    order, a call starting at each split kernel), as the median over a (workload, flush)'s calls."""
    calls: list[list[dict]] = []
    for kernel in kernels:
        if "split" in kernel["name"] or not calls:
            calls.append([])
        calls[-1].append(kernel)
    per_pair = order["calls"]
    pairs = [(w, f) for w in order["kernels"] for f in order["flushes"]]
    if len(calls) != len(pairs) * per_pair:
        raise FlashbenchError(f"the profile holds {len(calls)} calls; its order names {len(pairs) * per_pair}")
    rows = []
    for i, (workload, flush) in enumerate(pairs):
        group = calls[i * per_pair:(i + 1) * per_pair]
        median = lambda read: statistics.median(read(call) for call in group)  # noqa: E731
        rows.append([workload.removeprefix("MLA decode "), flush,
                     f"{median(lambda c: sum(k['gpu__time_duration.sum'] for k in c)) / 1e3:.1f}",
                     f"{median(lambda c: sum(k['dram__bytes_read.sum'] for k in c)) / 1e6:.1f}",
                     f"{median(lambda c: sum(k['dram__bytes_write.sum'] for k in c)) / 1e6:.1f}",
                     f"{median(lambda c: c[0]['lts__t_sector_hit_rate.pct']):.1f}"])
    return markdown(["workload", "flush before", "kernel µs", "DRAM read MB", "DRAM write MB", "L2 hit % (split)"], rows)


def clocks_table(traces: list[Trace], earlier: list[Trace]) -> str:
    before = current(earlier)
    rows = []
    for key, trace in current(traces).items():
        then = latency_us(before.get(key))
        if trace.solution == REFERENCE or then is None:
            continue
        perf = trace.performance
        if trace.status != "PASSED" or perf is None:
            rows.append([trace.solution, trace.workload_name, us(then), f"{trace.status}: {trace.message[:70]}", "", ""])
            continue
        clocks = perf.crosscheck
        worker = clocks.get("median_ms", clocks.get("worker", {}).get("latency_ms"))
        rows.append([trace.solution, trace.workload_name, us(then), us(worker * 1e3), us(perf.latency_ms * 1e3),
                     f"{perf.ci_low_ms * 1e3:.1f}-{perf.ci_high_ms * 1e3:.1f}"])
    return markdown(["solution", "workload", "earlier events (µs)", "worker events (µs)", "judge's clock (µs)",
                     "judge's 95% CI"], rows)


def adversarial_table(traces: list[Trace]) -> str:
    rows = [[t.solution, t.workload_name, t.status, t.message[:90]] for t in current(traces).values()
            if t.solution != REFERENCE]
    return markdown(["fixture", "workload", "status", "message"], rows)


def clock_excess_table(traces: list[Trace], workloads: list[Workload]) -> str:
    """Per passed pair: the judge's clock above the worker's CUDA events, per call and per batch."""
    latest = current(traces)
    rows, per_batch = [], []
    for workload, solution, trace in timed_pairs(latest, workloads):
        if trace.performance is None or "judge" not in trace.performance.crosscheck:
            continue
        clocks, size = trace.performance.crosscheck, trace.performance.timing["calls_per_batch"]
        judge, worker = clocks["judge"]["latency_ms"] * 1e3, clocks["worker"]["latency_ms"] * 1e3
        per_batch.append((judge - worker) * size / 1e3)
        rows.append([solution, workload.label, size, f"{judge:.1f}", f"{worker:.1f}", f"{judge - worker:.1f}",
                     f"{per_batch[-1]:.2f}"])
    table = markdown(["solution", "workload", "calls per batch", "judge (µs)", "worker events (µs)",
                      "judge above events, per call (µs)", "the same, per batch (ms)"], rows)
    if not per_batch:
        return table
    return table + (f"\n\nPer batch, the judge's clock reads a median {statistics.median(per_batch):.2f} ms above the "
                    f"worker's events (range {min(per_batch):.2f}-{max(per_batch):.2f} ms) over {len(per_batch)} passed pairs.")


def is_peer(trace: Trace) -> bool:
    return trace.solution in PEERS


def is_ours(trace: Trace) -> bool:
    return trace.solution not in (*PEERS, REFERENCE) and BASELINE_TAG not in trace.solution_tags


def peers_table(traces: list[Trace], workloads: list[Workload], calibration: Calibration | None,
                hashes: dict[str, str] | None = None) -> str:
    """`hashes`: each solution folder's content hash now; a cell measured on other content says `(stale)`.
    Without a calibration of the device there is no floor column."""
    latest = current(traces)

    def cell(found: tuple[str, float] | None) -> str:
        if not found:
            return NONE
        trace = latest[found[0], workload.uuid]
        now = (hashes or {}).get(trace.solution)
        stale = " (stale)" if now is not None and not same_content(trace.solution_hash, now) else ""
        return f"{found[0]}{stale}, {found[1]:.1f}" + (" host-bound" if timed_on_host(trace) else "")

    rows, speeds = [], []
    for workload in timed(workloads, latest):
        peer = fastest(latest, workload.uuid, is_peer)
        ours = fastest(latest, workload.uuid, is_ours)
        speed = floor = NONE
        if ours and calibration:
            sol_pct = with_speed_of_light(traces_frame([latest[ours[0], workload.uuid]]), calibration)["sol_pct"].iloc[0]
            floor = NONE if math.isnan(sol_pct) else f"{sol_pct:.0f}%"  # NaN: no cost model
        if peer and ours:
            speeds.append(peer[1] / ours[1])
            speed = f"{speeds[-1]:.2f}x"
        rows.append([workload.label, cell(peer), cell(ours), speed] + ([floor] if calibration else []))
    table = markdown(["workload", "best peer (solution, µs)", "ours, best (solution, µs)",
                      "ours / peer speed (peer µs ÷ ours)"] + (["ours % of floor"] if calibration else []), rows)
    if not speeds:
        return table + "\n\nNo workload has both a peer's and our result."
    return table + (f"\n\nGeomean of ours / peer speed over the {len(speeds)} workloads with both: "
                    f"{statistics.geometric_mean(speeds):.2f}x.")


def timed_on_host(trace: Trace) -> bool:
    """Boards' host-bound mark: by the worker's own report, the time is the host's Python and launches. A label
    only: the worker can report what it likes, so no figure leaves a cell out for it."""
    return trace.performance is not None and host_bound(trace.performance.timing)


def events_graph_table(events: list[Trace], graph: list[Trace], workloads: list[Workload],
                       solutions: list[str]) -> str:
    by_method = [current(events), current(graph)]
    rows = []
    for workload in timed(workloads, {**by_method[0], **by_method[1]}):
        cells = [" / ".join(us(latency_us(latest.get((s, workload.uuid)))) for latest in by_method) for s in solutions]
        rows.append([workload.label, *cells])
    return markdown(["workload (events µs / graph µs)", *solutions], rows)


def events_us(trace: Trace | None) -> float | None:
    """The worker's own CUDA-event median (advisory: the ranked figure is latency_us)."""
    if latency_us(trace) is None or "worker" not in trace.performance.crosscheck:
        return None
    return trace.performance.crosscheck["worker"]["latency_ms"] * 1e3


def paired(a: list[Trace], b: list[Trace], workloads: list[Workload],
           clock=latency_us) -> list[tuple[str, str, float, float]]:
    """(solution, workload label, µs in a, µs in b) of every timed pair that passed in both, in a's order."""
    first, second = current(a), current(b)
    labels = {w.uuid: w.label for w in timed(workloads, first)}
    found = [(key, clock(trace), clock(second.get(key))) for key, trace in first.items()]
    return [(s, labels[w], x, y) for (s, w), x, y in found if w in labels and x is not None and y is not None]


def repeat_table(a: list[Trace], b: list[Trace], workloads: list[Workload], clock=latency_us) -> str:
    """The solutions under test only: the reference (a host-bound PyTorch loop) is left out."""
    pairs = [pair for pair in paired(a, b, workloads, clock) if pair[0] != REFERENCE]
    diffs = [(abs(y - x) / x * 100, f"{s} {w}") for s, w, x, y in pairs]
    rows = [[s, w, us(x), us(y), f"{d:.1f}"] for (s, w, x, y), (d, _) in zip(pairs, diffs)]
    return markdown(["solution", "workload", "A µs", "B µs", "|diff| %"], rows) + "\n\n" + spread(diffs, "|diff|")


def moved_table(old: list[Trace], new: list[Trace], workloads: list[Workload]) -> str:
    pairs = paired(old, new, workloads)
    changes = [(y - x) / x * 100 for _, _, x, y in pairs]
    rows = [[s, w, us(x), us(y), f"{c:+.1f}"] for (s, w, x, y), c in zip(pairs, changes)]
    hashes = [{t.solution: t.solution_hash for t in traces} for traces in (old, new)]  # the newest of each
    both = [s for s in hashes[0] if s in hashes[1]]
    same = [s for s in both if same_content(hashes[0][s], hashes[1][s])]
    changed = [f"{s} ({hashes[0][s][:8]} → {hashes[1][s][:8]})" for s in both if s not in same]
    return (markdown(["solution", "workload", "old µs", "new µs", "change %"], rows) + "\n\n"
            + spread([(abs(c), f"{s} {w}") for (s, w, _, _), c in zip(pairs, changes)], "|change|") + "\n\n"
            + f"Content hash changed (the folder changed, not only the method): {', '.join(changed) or 'none'}; "
            + f"unchanged: {', '.join(same) or 'none'}.")


def rejections_table(files: dict[str, list[Trace]], honest: dict[str, set[str]]) -> str:
    """files: a label per trace file -> its traces; honest: definition -> the solutions with a folder."""
    pairs = [(label, t) for label, traces in files.items() for t in current(traces).values()
             if t.solution in honest.get(t.definition, set())]
    counts = {status: sum(t.status == status for _, t in pairs) for status in get_args(Status)}
    table = markdown(["status", "honest pairs"], [[s, n] for s, n in counts.items() if n])
    rejected = [[label, t.solution, t.workload_name or t.workload[:8], t.message] for label, t in pairs
                if t.status == "REJECTED"]
    if rejected:
        table += "\n\n" + markdown(["file", "solution", "workload", "message"], rejected)
    return table + f"\n\n{len(rejected)} REJECTED of {len(pairs)} honest pairs."


# Reading: the edges.

def path_of(arg: str) -> Path:
    return ROOT / arg  # an absolute arg stays itself


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def need(path: Path) -> Path:
    if not path.is_file():
        raise FlashbenchError("no such file", rel(path))
    return path


def read(path: Path) -> list[Trace]:
    return read_traces(need(path))


@cache
def repo() -> Repo:
    return Repo(ROOT)


def definition_of(traces: list[Trace], path: Path) -> str:
    names = sorted({t.definition for t in traces})
    if len(names) != 1:
        raise FlashbenchError(f"holds traces of {len(names)} definitions, not one: {', '.join(names)}", rel(path))
    return names[0]


def workloads_of(definition: str) -> list[Workload]:
    workload_set = repo().workload_set(definition)
    if workload_set is None:
        raise FlashbenchError("no workload set", rel(repo().workloads_path(definition)))
    return workload_set.workloads


def devices(*groups: list[Trace]) -> set[str]:
    return {t.hardware for traces in groups for t in traces}


def build_flush(file):
    path = path_of(file)
    records = json.loads(need(path).read_text())
    return flush_table(records), [f"`{rel(path)}`"], {r["device"] for r in records if r.get("device")}


def build_keyed_flush(file):
    path = path_of(file)
    document = json.loads(need(path).read_text())
    return keyed_flush_table(document["records"]), [f"`{rel(path)}`"], {document["device"]}


def compare_table(times: dict[str, dict[str, float]]) -> str:
    """times: workload -> label -> µs, from a compare log; ours are the default launches only."""
    rows = []
    for workload, by_label in times.items():
        best = {}
        for revision in ("old", "new"):
            defaults = {f"{kernel} {revision}": kernel for kernel in ("splitkv", "balanced")}
            ours = [(time, defaults[label]) for label, time in by_label.items() if label in defaults]
            best[revision] = min(ours) if ours else None
        old, new = best["old"], best["new"]
        rows.append([workload, us(by_label.get("flashmla")), f"{old[1]}, {us(old[0])}" if old else "—",
                     f"{new[1]}, {us(new[0])}" if new else "—",
                     f"{old[0] / new[0]:.2f}x" if old and new else "—"])
    return markdown(["workload", "FlashMLA (µs)", "ours, old (kernel, µs)", "ours, new (kernel, µs)",
                     "new / old speed"], rows)


# A kernel's output this far from FlashMLA's is wrong, not rounded: bf16 outputs of a softmax-weighted sum
# differ by at most a few units in the second decimal (docs/data/decode_variants_h100/).
WRONG_OUTPUT = 0.1


def configs_log(file) -> tuple[dict[str, dict[str, tuple[float, float | None]]], Path, set[str]]:
    """A `benchmarks/flashmla_decode_configs.py` log: workload -> label -> (µs, largest difference from
    FlashMLA's output or None), its path, and the devices it names."""
    path = need(path_of(file))
    times: dict[str, dict[str, tuple[float, float | None]]] = {}
    device = set()
    for line in path.read_text().splitlines():
        if line.startswith("# device: "):
            device.add(line.removeprefix("# device: ").strip())
        elif found := re.match(r"(\S+)\s+(.+?)\s+([0-9.]+) us(?:\s+err (\S+))?", line):
            error = float(found[4]) if found[4] else None
            times.setdefault(found[1], {})[found[2].strip()] = (float(found[3]), error)
    if not times:
        raise FlashbenchError(f"{rel(path)}: no timed lines")
    return times, path, device


def build_compare(file):
    times, path, device = configs_log(file)
    plain = {workload: {label: time for label, (time, _) in by_label.items()} for workload, by_label in times.items()}
    return compare_table(plain), [f"`{rel(path)}`"], device


def variants_table(times: dict[str, dict[str, tuple[float, float | None]]]) -> str:
    """times as configs_log gives them: a column per label (FlashMLA first), then our fastest correct
    launch and its speed against FlashMLA's."""
    labels = list(dict.fromkeys(label for by_label in times.values() for label in by_label if label != "flashmla"))
    rows = []
    for workload, by_label in times.items():
        cells, ours = [], []
        for label in labels:
            time, error = by_label.get(label, (None, None))
            wrong = error is not None and not error <= WRONG_OUTPUT  # a NaN difference is wrong too
            cells.append("—" if time is None else f"{us(time)} (wrong: {error:.3g})" if wrong else us(time))
            if time is not None and not wrong:
                ours.append((time, label))
        peer = by_label.get("flashmla", (None, None))[0]
        best = min(ours) if ours else None
        rows.append([workload, us(peer), *cells, f"{best[1]}, {peer / best[0]:.2f}x" if best and peer else "—"])
    return markdown(["workload", "FlashMLA (µs)", *[f"{label} (µs)" for label in labels],
                     "fastest of ours, its speed / FlashMLA's"], rows)


def build_variants(file):
    times, path, device = configs_log(file)
    return variants_table(times), [f"`{rel(path)}`"], device


def build_flush_profile(file):
    """Nsight Compute's --csv output: the program's first JSON line (what it profiled, in order), then
    one row per (kernel launch, metric)."""
    path = need(path_of(file))
    lines = path.read_text().splitlines()
    order = next((json.loads(line) for line in lines if line.startswith("{")), None)
    if order is None:
        raise FlashbenchError(f"{rel(path)}: no line saying what was profiled")
    kernels: dict[str, dict] = {}
    for row in csv.DictReader(line for line in lines if line.startswith('"')):
        kernel = kernels.setdefault(row["ID"], {"name": row["Kernel Name"]})
        kernel[row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
    ordered = [kernels[key] for key in sorted(kernels, key=int)]
    return flush_profile_table(order, ordered), [f"`{rel(path)}`"], {"NVIDIA H200"} if ordered else set()


NCU_KERNEL = re.compile(r"^  (?:void )?(?P<name>[A-Za-z_][\w:]*).*\((?P<grid>[\d, ]+)\)x\((?P<block>[\d, ]+)\), Context")
NCU_METRIC = re.compile(r"^    (?P<metric>\S.*?)\s{2,}(?P<unit>\S*)\s+(?P<value>[\d,.]+)$")
NCU_PIPELINE = re.compile(r"(?P<pipe>\w+) is the highest-utilized pipeline \((?P<pct>[\d.]+)%\)")
NCU_TIME_UNITS = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}  # to µs
NCU_SIZE_UNITS = {"byte/block": 1e-3, "Kbyte/block": 1.0, "Mbyte/block": 1e3}  # to KB


def ncu_kernels(text: str) -> list[dict]:
    """The kernels of an Nsight Compute text report, in launch order, with their metrics by name."""
    kernels: list[dict] = []
    for line in text.splitlines():
        if found := NCU_KERNEL.match(line):
            kernels.append({"name": found["name"].rpartition("::")[2], "grid": found["grid"].replace(" ", ""),
                            "block": found["block"].replace(" ", "")})
        elif kernels and (found := NCU_METRIC.match(line)):
            kernels[-1].setdefault(found["metric"], (float(found["value"].replace(",", "")), found["unit"]))
        elif kernels and (found := NCU_PIPELINE.search(line)):
            kernels[-1].setdefault("pipeline", f"{found['pipe']} {found['pct']}%")
    return kernels


def ncu_table(reports: dict[str, str]) -> str:
    """reports: file stem (DEFINITION__SOLUTION__WORKLOAD) -> its text."""
    rows = []
    for stem, text in reports.items():
        definition, solution, workload = stem.split("__")
        for kernel in ncu_kernels(text):
            def reading(metric: str, units: dict[str, float] | None = None, digits: int = 0) -> str:
                value, unit = kernel.get(metric, (None, ""))
                if value is None:
                    return NONE
                if units is not None and unit not in units:
                    raise FlashbenchError(f"{stem}: {metric} in {unit!r}, which this table does not convert")
                return f"{value * (units[unit] if units else 1):.{digits}f}"

            rows.append([definition, solution, workload, kernel["name"], reading("Duration", NCU_TIME_UNITS, 1),
                         reading("DRAM Throughput"), reading("Compute (SM) Throughput"), kernel.get("pipeline", NONE),
                         f"{kernel['grid']} x {kernel['block']}", reading("Registers Per Thread"),
                         reading("Dynamic Shared Memory Per Block", NCU_SIZE_UNITS, 1), reading("Achieved Occupancy")])
    return markdown(["definition", "solution", "workload", "kernel", "µs", "DRAM %", "SM %", "busiest pipeline",
                     "grid x block", "registers", "dyn. smem KB", "occupancy %"], rows)


def build_ncu(*file_or_glob):
    paths = sorted({Path(found) for pattern in file_or_glob for found in glob.glob(str(path_of(pattern)))})
    if not paths:
        raise FlashbenchError(f"no Nsight Compute report matches {' '.join(file_or_glob) or 'nothing'}")
    bad = [rel(path) for path in paths if path.stem.count("__") != 2]
    if bad:
        raise FlashbenchError(f"{bad[0]}: not named DEFINITION__SOLUTION__WORKLOAD.txt")
    smi = {need(path.parent / "nvidia_smi.csv") for path in paths}
    hardware = {line.split(",")[0].strip() for file in smi for line in file.read_text().splitlines()[1:] if line}
    table = ncu_table({path.stem: path.read_text() for path in paths})
    return table, [f"`{rel(path)}`" for path in paths] + [f"`{rel(file)}` (device)" for file in sorted(smi)], hardware


def build_clocks(file, earlier):
    paths = [path_of(file), path_of(earlier)]
    traces, before = read(paths[0]), read(paths[1])
    return clocks_table(traces, before), [f"`{rel(paths[0])}`", f"`{rel(paths[1])}` (earlier)"], devices(traces, before)


def build_adversarial(file):
    traces = read(path_of(file))
    return adversarial_table(traces), [f"`{rel(path_of(file))}`"], devices(traces)


def build_peers(trace_file):
    path = path_of(trace_file)
    traces = read(path)
    calibration_file = path.parent / "calibration.json"  # where there is none, the table has no floor
    calibration = load_model(Calibration, calibration_file) if calibration_file.exists() else None
    definition = definition_of(traces, path)
    table = peers_table(traces, workloads_of(definition), calibration, solution_hashes(repo(), definition))
    sources = [f"`{rel(path)}`"] + ([f"`{rel(calibration_file)}` (floor)"] if calibration else [])
    return table, sources, devices(traces)


def build_events_graph(definition, *solution):
    paths = [trace_path(ROOT / "traces", HARDWARE, definition, method) for method in TIMING_METHODS]
    events, graph = (read(path) for path in paths)
    solutions = list(solution) or list(dict.fromkeys(t.solution for t in events if t.solution != REFERENCE))
    table = events_graph_table(events, graph, workloads_of(definition), solutions)
    return table, [f"`{rel(p)}` ({m})" for p, m in zip(paths, ("events", "graph replay"))], devices(events, graph)


def steps_table(traces: list[Trace], workloads: list[Workload]) -> str:
    latest = current(traces)
    rows, gaps = [], []
    for workload, solution, trace in timed_pairs(latest, workloads):
        if solution == REFERENCE or events_us(trace) is None:
            continue
        steps = {k: v * 1e3 for k, v in trace.performance.timing.get("steps_per_call_ms", {}).items() if v}
        if "subtracted" not in steps:
            continue
        gaps.append(steps["median"] - steps["subtracted"])
        rows.append([solution, workload.label, f"{latency_us(trace) - events_us(trace):.1f}",
                     *(us(steps.get(k)) for k in ("subtracted", "least", "median", "clean")), f"{gaps[-1]:.1f}"])
    table = markdown(["solution", "workload", "judge above events (µs/call)", "steps taken away (µs/call)",
                      "least of the job's readings", "median of them", "clean (measured apart)",
                      "median less taken away"], rows)
    if not gaps:
        return table
    return table + (f"\n\nThe steps taken away lie a median {statistics.median(gaps):.1f} µs per call below the median of "
                    f"the job's own readings (range {min(gaps):.1f} to {max(gaps):.1f}) over {len(gaps)} pairs.")


def two_files(a, b, labels):
    paths = [path_of(a), path_of(b)]
    first, second = read(paths[0]), read(paths[1])
    names = {definition_of(first, paths[0]), definition_of(second, paths[1])}
    if len(names) != 1:
        raise FlashbenchError(f"{rel(paths[0])} and {rel(paths[1])} are of different definitions")
    sources = [f"`{rel(p)}` ({label})" for p, label in zip(paths, labels)]
    return first, second, workloads_of(names.pop()), sources, devices(first, second)


def build_repeat(file_a, file_b):
    a, b, workloads, sources, hardware = two_files(file_a, file_b, ("A", "B"))
    return repeat_table(a, b, workloads), sources, hardware


def build_repeat_events(file_a, file_b):
    a, b, workloads, sources, hardware = two_files(file_a, file_b, ("A", "B"))
    return repeat_table(a, b, workloads, clock=events_us), sources, hardware


def build_moved(old_file, new_file):
    old, new, workloads, sources, hardware = two_files(old_file, new_file, ("old", "new"))
    return moved_table(old, new, workloads), sources, hardware


def one_file(file, table):
    """A table of one trace file's records, given its definition's workloads."""
    path = path_of(file)
    traces = read(path)
    return table(traces, workloads_of(definition_of(traces, path))), [f"`{rel(path)}`"], devices(traces)


def build_clock_excess(file):
    return one_file(file, clock_excess_table)


def build_steps(file):
    return one_file(file, steps_table)


def build_rejections(*file_or_glob):
    if not file_or_glob:
        raise FlashbenchError(f"usage: {COMMAND} {usage('rejections')}")
    paths = []
    for pattern in file_or_glob:
        found = sorted(glob.glob(str(path_of(pattern))))
        if not found:
            raise FlashbenchError("no such file", pattern)
        paths += [Path(p) for p in found]
    files = {rel(p): read(p) for p in dict.fromkeys(paths)}
    definitions = {t.definition for traces in files.values() for t in traces}
    honest = {d: {f.solution.name for f in repo().solution_folders(d)} if d in repo().names() else set()
              for d in definitions}
    return rejections_table(files, honest), [", ".join(f"`{f}`" for f in files)], devices(*files.values())


BUILDERS = {"flush": build_flush, "clocks": build_clocks, "adversarial": build_adversarial, "peers": build_peers,
            "events_graph": build_events_graph, "repeat": build_repeat, "repeat_events": build_repeat_events,
            "moved": build_moved,
            "rejections": build_rejections, "clock_excess": build_clock_excess, "steps": build_steps,
            "flush_profile": build_flush_profile, "ncu": build_ncu, "keyed_flush": build_keyed_flush,
            "compare": build_compare, "variants": build_variants}


def usage(name: str) -> str:
    params = inspect.signature(BUILDERS[name]).parameters.values()
    words = " ".join(p.name.upper() + ("..." if p.kind == p.VAR_POSITIONAL else "") for p in params)
    return f"{name} [{words}]" if name in DEFAULTS else f"{name} {words}"


def make(name: str, args: list[str]) -> str:
    """One table: its source line, then the table."""
    if name not in BUILDERS:
        raise FlashbenchError(f"no table {name!r}; known: {', '.join(BUILDERS)}")
    args = list(args) or DEFAULTS.get(name, [])
    try:
        inspect.signature(BUILDERS[name]).bind(*args)
    except TypeError:
        raise FlashbenchError(f"usage: {COMMAND} {usage(name)}") from None
    table, sources, hardware = BUILDERS[name](*args)
    return (f"Source: {', '.join(sources)}, on {', '.join(sorted(hardware)) or 'a device not recorded'}; "
            f"made by `{COMMAND} {' '.join([name, *args])}`.\n\n{table}")


# Generated blocks in Markdown.

def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def sync(files: list[Path], write: bool = False) -> tuple[list[str], list[str]]:
    """(out-of-date blocks, failing blocks), a line each naming the file and table; with write, out-of-date
    blocks are regenerated (a failing block is left as it is)."""
    stale, failed = [], []

    def regenerate(match: re.Match, where: str) -> str:
        name, *args = match["spec"].split()
        try:
            body = f"\n{make(name, args)}\n\n"
        except FlashbenchError as exc:
            failed.append(f"{where}: table {name}: {exc}")
            return match[0]
        if body != match["body"]:
            stale.append(f"{where}: table {name} is out of date")
        return f"<!-- table: {match['spec']} -->\n{body}<!-- /table -->"

    for path in files:
        text = path.read_text()
        new = BLOCK.sub(lambda match: regenerate(match, rel(path)), text)
        if len(OPEN.findall(text)) != len(BLOCK.findall(text)):
            failed.append(f"{rel(path)}: a `<!-- table: ... -->` line without its `<!-- /table -->`")
        if write and new != text:
            path.write_text(new)
    return stale, failed


def main(argv: list[str]) -> int:
    if argv in (["--check"], ["--write"]):
        stale, failed = sync(markdown_files(), write=argv == ["--write"])
        for line in stale:
            print(line.replace("is out of date", "rewritten") if argv == ["--write"] else line)
        for line in failed:
            print(line, file=sys.stderr)
        return 1 if failed or (stale and argv == ["--check"]) else 0
    if not argv or argv[0].startswith("-"):
        print(f"usage: {COMMAND} --check | --write | NAME ARGS\ntables:\n  "
              + "\n  ".join(usage(name) for name in BUILDERS), file=sys.stderr)
        return 2
    try:
        print(make(argv[0], argv[1:]))
    except FlashbenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
