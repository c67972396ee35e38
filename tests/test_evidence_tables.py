"""benchmarks/evidence_tables.py: the committed README and docs hold what their tables' data give, and
each table, the record rule and the generated blocks on small hand-made traces."""

import importlib.util
import json
from pathlib import Path

import pytest
from trace_factory import CALIBRATION, EVENTS, make_trace

from flashbench.model import Workload

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("evidence_tables", ROOT / "benchmarks" / "evidence_tables.py")
et = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(et)

SMOKE, SMALL, LARGE, HUGE = "smoke-1111", "small-2222", "large-3333", "huge-4444"
WORKLOADS = [Workload(uuid=SMOKE, name="smoke", tags=["smoke"]), Workload(uuid=SMALL, name="small"),
             Workload(uuid=LARGE, name="large"), Workload(uuid=HUGE, name="huge")]


def rows(markdown: str) -> list[list[str]]:
    """The body rows of the first Markdown table, as cells."""
    lines = [line for line in markdown.split("\n\n")[0].splitlines()][2:]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines]


def last_line(markdown: str) -> str:
    return markdown.splitlines()[-1]


def test_committed_readme_and_docs_are_up_to_date():
    stale, failed = et.sync(et.markdown_files())
    assert failed == []
    assert stale == [], "run `python benchmarks/evidence_tables.py --write`"


def test_the_newest_hash_and_its_latest_record_count_whatever_the_status():
    traces = [make_trace("a", SMALL, 1.0, solution_hash="old"),  # an older hash: out
              make_trace("a", LARGE, status="REJECTED", solution_hash="new"),
              make_trace("a", LARGE, 2.0, solution_hash="new"),  # a re-run replaces the rejection
              make_trace("b", SMALL, 1.0), make_trace("b", SMALL, status="INCORRECT_NUMERICAL")]  # a failed re-run wins
    current = et.current(traces)
    assert list(current) == [("a", LARGE), ("b", SMALL)]
    assert et.latency_us(current["a", LARGE]) == 2000.0
    assert current["b", SMALL].status == "INCORRECT_NUMERICAL" and et.latency_us(current["b", SMALL]) is None


def test_peers_best_peer_against_our_best_with_share_of_floor_and_geomean():
    traces = [make_trace("flashinfer_fa3", SMALL, 2.0, tags=["baseline"]), make_trace("flashmla", SMALL, 1.5),
              make_trace("triton", SMALL, 1.0, nbytes=5e8), make_trace("cuda", SMALL, 3.0),
              make_trace("torch_vectorized", SMALL, 0.1, tags=["baseline"]), make_trace("reference", SMALL, 0.1),
              make_trace("flashmla", LARGE, 1.0), make_trace("cuda", LARGE, 4.0, nbytes=None, flops=None),
              make_trace("triton", LARGE, status="REJECTED"), make_trace("flashmla", HUGE, 1.0),
              make_trace("triton", SMOKE, 0.01)]
    table = et.peers_table(traces, WORKLOADS, CALIBRATION)
    assert rows(table) == [
        ["small", "flashmla, 1500.0", "triton, 1000.0", "1.50x", "50%"],  # 0.5 GB at 1 TB/s: a 0.5 ms floor
        ["large", "flashmla, 1000.0", "cuda, 4000.0", "0.25x", "—"],  # no cost model: no floor
        ["huge", "flashmla, 1000.0", "—", "—", "—"],
    ]
    assert last_line(table) == "Geomean of ours / peer speed over the 2 workloads with both: 0.61x."
    assert last_line(et.peers_table(traces[-2:], WORKLOADS, CALIBRATION)) == "No workload has both a peer's and our result."


def test_peers_cells_timed_on_the_host_say_so_and_still_count():
    """The mark rests on the worker's report, which a solution can forge: a label, never a reason to leave a
    workload out of the geomean."""
    host = {**EVENTS, "worker_issue_share": 0.97}
    traces = [make_trace("flashmla", SMALL, 4.0, timing=host), make_trace("triton", SMALL, 1.0),
              make_trace("flashmla", LARGE, 1.0),
              make_trace("triton", LARGE, 2.0, timing={**EVENTS, "worker_issue_share": 0.5})]
    table = et.peers_table(traces, WORKLOADS, None)
    assert rows(table) == [["small", "flashmla, 4000.0 host-bound", "triton, 1000.0", "4.00x"],
                           ["large", "flashmla, 1000.0", "triton, 2000.0", "0.50x"]]
    assert last_line(table) == "Geomean of ours / peer speed over the 2 workloads with both: 1.41x."


def test_peers_without_a_calibration_of_the_device_has_no_floor_column():
    traces = [make_trace("flashmla", SMALL, 1.5), make_trace("triton", SMALL, 1.0, nbytes=5e8)]
    table = et.peers_table(traces, WORKLOADS, None)
    assert "% of floor" not in table
    assert rows(table) == [["small", "flashmla, 1500.0", "triton, 1000.0", "1.50x"]]


def test_keyed_flush_lists_each_pass_and_flush_with_its_time():
    table = et.keyed_flush_table([{"what": "flush read (whole)", "us": 538.46}, {"what": "float32 sum pass", "us": 107.7}])
    assert rows(table) == [["flush read (whole)", "538.5"], ["float32 sum pass", "107.7"]]


def test_compare_gives_the_faster_default_kernel_of_each_revision(tmp_path):
    log = tmp_path / "compare.txt"
    log.write_text("# device: GPU X\n"
                   "b1   flashmla          50.0 us\n"
                   "b1   splitkv old      100.0 us  err 0.1\n"
                   "b1   splitkv new       90.0 us  err 0.1\n"
                   "b1   balanced old     120.0 us  err 0.1\n"
                   "b1   balanced new      80.0 us  err 0.1\n"
                   "b1   balanced new units=132   10.0 us  err 0.1\n")  # not a default launch: left out
    table, sources, device = et.build_compare(str(log))
    assert rows(table) == [["b1", "50.0", "splitkv, 100.0", "balanced, 80.0", "1.25x"]]
    assert device == {"GPU X"}
    log.write_text("no timings\n")
    try:
        et.build_compare(str(log))
    except et.FlashbenchError as error:
        assert "no timed lines" in str(error)
    else:
        raise AssertionError("a log without timings gave a table")


def test_variants_give_a_column_per_launch_and_the_fastest_correct_one(tmp_path):
    log = tmp_path / "defaults.txt"
    log.write_text("# device: GPU X\n# definition: d\n"
                   "b1   flashmla              50.0 us\n"
                   "b1   splitkv default      100.0 us  err 0.0156\n"
                   "b1   flat default          20.0 us  err 3.5\n"  # fast and wrong: not the fastest
                   "b1   balanced fit          40.0 us  err nan\n"
                   "b2   flashmla              10.0 us\n"
                   "b2   flat default           8.0 us  err 0.001\n")
    table, sources, device = et.build_variants(str(log))
    assert rows(table) == [["b1", "50.0", "100.0", "20.0 (wrong: 3.5)", "40.0 (wrong: nan)", "splitkv default, 0.50x"],
                           ["b2", "10.0", "—", "8.0", "—", "flat default, 1.25x"]]
    assert device == {"GPU X"}


def test_peers_cells_measured_on_other_content_than_the_folder_holds_now_say_stale():
    traces = [make_trace("flashmla", SMALL, 1.5), make_trace("triton", SMALL, 1.0)]
    hashes = {"flashmla": "flashmla-hash", "triton": "edited since"}
    assert rows(et.peers_table(traces, WORKLOADS, CALIBRATION, hashes))[0][1:3] == \
        ["flashmla, 1500.0", "triton (stale), 1000.0"]


def test_events_graph_cells_are_events_slash_graph_for_the_chosen_solutions():
    events = [make_trace("x", SMALL, 1.0), make_trace("y", SMALL, 2.0), make_trace("x", LARGE, status="REJECTED"),
              make_trace("x", SMOKE, 0.1), make_trace("z", HUGE, 9.0)]
    graph = [make_trace("x", SMALL, 0.8), make_trace("x", LARGE, 0.5), make_trace("x", SMOKE, 0.1)]
    table = et.events_graph_table(events, graph, WORKLOADS, ["y", "x"])
    assert table.splitlines()[0] == "| workload (events µs / graph µs) | y | x |"
    assert rows(table) == [["small", "2000.0 / —", "1000.0 / 800.0"], ["large", "— / —", "— / 500.0"],
                           ["huge", "— / —", "— / —"]]


def test_repeat_lists_pairs_passed_in_both_and_the_median_and_max_difference():
    a = [make_trace("x", SMALL, 1.0), make_trace("x", LARGE, 2.0), make_trace("y", SMALL, 4.0),
         make_trace("y", LARGE, 1.0), make_trace("x", SMOKE, 1.0)]
    b = [make_trace("x", SMALL, 1.1), make_trace("x", LARGE, 2.0), make_trace("y", SMALL, 3.0),
         make_trace("y", LARGE, status="TIMEOUT"), make_trace("x", SMOKE, 5.0)]
    table = et.repeat_table(a, b, WORKLOADS)
    assert rows(table) == [["x", "small", "1000.0", "1100.0", "10.0"], ["x", "large", "2000.0", "2000.0", "0.0"],
                           ["y", "small", "4000.0", "3000.0", "25.0"]]
    assert last_line(table) == "Median |diff| 10.0%, max 25.0% (y small), over 3 (solution, workload) pairs."
    assert last_line(et.repeat_table(a, [], WORKLOADS)) == "No (solution, workload) pair passed in both."


def test_moved_gives_signed_changes_and_whose_hash_changed():
    old = [make_trace("x", SMALL, 1.0, solution_hash="x1"), make_trace("y", SMALL, 2.0, solution_hash="y1"),
           make_trace("gone", SMALL, 1.0)]
    new = [make_trace("x", SMALL, 0.5, solution_hash="x2"), make_trace("y", SMALL, 2.2, solution_hash="y1")]
    table = et.moved_table(old, new, WORKLOADS)
    assert rows(table) == [["x", "small", "1000.0", "500.0", "-50.0"], ["y", "small", "2000.0", "2200.0", "+10.0"]]
    summary, hashes = table.split("\n\n")[-2:]
    assert summary == "Median |change| 30.0%, max 50.0% (x small), over 2 (solution, workload) pairs."
    assert hashes == "Content hash changed (the folder changed, not only the method): x (x1 → x2); unchanged: y."


def test_rejections_counts_honest_pairs_only_and_lists_each_rejection():
    one = [make_trace("x", SMALL, 1.0), make_trace("x", LARGE, status="REJECTED"),
           make_trace("x", LARGE, 1.0),  # re-run: passed
           make_trace("evil", SMALL, status="REJECTED"), make_trace("reference", SMALL, 1.0)]
    two = [make_trace("y", SMOKE, status="REJECTED").model_copy(update={"message": "a | b"}),
           make_trace("y", SMALL, status="TIMEOUT")]
    table = et.rejections_table({"one.jsonl": one, "two.jsonl": two}, {"d": {"x", "y"}})
    assert rows(table) == [["PASSED", "2"], ["TIMEOUT", "1"], ["REJECTED", "1"]]
    assert "| two.jsonl | y | smoke | a \\| b |" in table  # a | in a message is escaped
    assert last_line(table) == "1 REJECTED of 4 honest pairs."


def test_flush_clocks_and_adversarial_tables():
    records = [{"kernel": "copy", "flush": "write", "median_us": 10.04}, {"kernel": "copy", "flush": "none", "median_us": 9.0},
               {"kernel": "sum", "flush": "write", "median_us": 5.0}]
    assert et.flush_table(records).splitlines() == ["| kernel | after write | after none |", "|---|---|---|",
                                                    "| copy | 10.0 | 9.0 |", "| sum | 5.0 | — |"]
    judged = make_trace("x", SMALL, 0.2, ci=0.1)
    judged.performance.crosscheck = {"median_ms": 0.15}
    new = [judged, make_trace("x", LARGE, status="REJECTED").model_copy(update={"message": "clocks disagree"}),
           make_trace("reference", SMALL, 1.0), make_trace("y", SMALL, 1.0)]
    earlier = [make_trace("x", SMALL, 0.1), make_trace("x", LARGE, 0.3), make_trace("reference", SMALL, 2.0)]
    assert rows(et.clocks_table(new, earlier)) == [["x", "small", "100.0", "150.0", "200.0", "100.0-300.0"],
                                                   ["x", "large", "300.0", "REJECTED: clocks disagree", "", ""]]
    assert rows(et.adversarial_table(new)) == [["x", "small", "PASSED", ""], ["x", "large", "REJECTED", "clocks disagree"],
                                               ["y", "small", "PASSED", ""]]


def test_check_names_stale_and_failing_blocks_and_write_regenerates_the_stale_ones(tmp_path):
    data = tmp_path / "flush.json"
    data.write_text(json.dumps([{"kernel": "copy", "flush": "write", "median_us": 1.0, "device": "GPU X"}]))
    doc = tmp_path / "doc.md"
    failing = f"<!-- table: flush {tmp_path}/missing.json -->\nold\n<!-- /table -->\n"
    doc.write_text(f"Intro.\n\n<!-- table: flush {data} -->\n| typed by hand |\n<!-- /table -->\n\n{failing}")
    stale, failed = et.sync([doc])
    assert stale == [f"{doc}: table flush is out of date"]
    assert failed == [f"{doc}: table flush: {tmp_path}/missing.json: no such file"]

    et.sync([doc], write=True)
    assert et.sync([doc]) == ([], failed)
    text = doc.read_text()
    assert text.startswith(f"Intro.\n\n<!-- table: flush {data} -->\n\nSource: `{data}`, on GPU X; made by "
                           f"`python benchmarks/evidence_tables.py flush {data}`.\n\n| kernel | after write |")
    assert text.endswith(f"| copy | 1.0 |\n\n<!-- /table -->\n\n{failing}")  # the failing block is left as it was

    doc.write_text("<!-- table: flush -->\nnever closed\n")
    assert et.sync([doc])[1] == [f"{doc}: a `<!-- table: ... -->` line without its `<!-- /table -->`"]


def test_one_table_from_the_command_line_and_its_errors(capsys):
    assert et.main(["flush"]) == 0
    assert capsys.readouterr().out.startswith("Source: `docs/data/l2_flush_h200.json`, on NVIDIA H200; made by "
                                              "`python benchmarks/evidence_tables.py flush docs/data/l2_flush_h200.json`.")
    assert et.main(["peers", "no/such.jsonl"]) == 2
    assert capsys.readouterr().err == "error: no/such.jsonl: no such file\n"
    assert et.main(["repeat", "one.jsonl"]) == 2
    assert capsys.readouterr().err == "error: usage: python benchmarks/evidence_tables.py repeat FILE_A FILE_B\n"
    assert et.main(["rejections", "no/*.jsonl"]) == 2
    assert capsys.readouterr().err == "error: no/*.jsonl: no such file\n"


def test_clock_excess_gives_the_judges_excess_per_call_and_per_batch():
    def timed(solution, workload, judge_ms, worker_ms, calls):
        trace = make_trace(solution, workload, judge_ms, timing={"method": "events", "calls_per_batch": calls})
        trace.performance.crosscheck = {"judge": {"latency_ms": judge_ms}, "worker": {"latency_ms": worker_ms}}
        return trace

    traces = [timed("x", SMALL, 0.05, 0.03, 50), timed("y", LARGE, 0.5, 0.49, 100), make_trace("z", SMALL, 1.0),
              make_trace("x", LARGE, status="REJECTED"), timed("x", SMOKE, 0.02, 0.01, 10)]
    table = et.clock_excess_table(traces, WORKLOADS)
    assert rows(table) == [["x", "small", "50", "50.0", "30.0", "20.0", "1.00"],
                           ["y", "large", "100", "500.0", "490.0", "10.0", "1.00"]]  # z has no clocks; smoke left out
    assert last_line(table).startswith("Per batch, the judge's clock reads a median 1.00 ms above")


def test_steps_gives_what_was_taken_away_against_the_jobs_own_readings():
    def timed(solution, workload, judge_ms, worker_ms, steps):
        trace = make_trace(solution, workload, judge_ms, timing={"method": "events", "steps_per_call_ms": steps})
        trace.performance.crosscheck = {"judge": {"latency_ms": judge_ms}, "worker": {"latency_ms": worker_ms}}
        return trace

    steps = {"subtracted": 0.320, "least": 0.324, "median": 0.326, "clean": 0.320}
    traces = [timed("x", SMALL, 0.05, 0.04, steps), timed("reference", SMALL, 1.0, 0.9, steps),
              timed("y", LARGE, 0.5, 0.49, {**steps, "clean": None, "subtracted": 0.324}),
              timed("x", SMOKE, 0.02, 0.01, steps), make_trace("z", LARGE, 1.0)]
    table = et.steps_table(traces, WORKLOADS)
    assert rows(table) == [["x", "small", "10.0", "320.0", "324.0", "326.0", "320.0", "6.0"],
                           ["y", "large", "10.0", "324.0", "324.0", "326.0", "—", "2.0"]]  # no reference, smoke, clocks
    assert last_line(table).startswith("The steps taken away lie a median 4.0 µs per call below")


NCU_REPORT = """==PROF== Connected to process 1 (/usr/bin/python3)
[1] python3@127.0.0.1
  void ns::kernel_a<T, 4>(Params) (2, 1, 66)x(256, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    DRAM Throughput                   %        72.42
    Duration                         ms         1.25
    Compute (SM) Throughput           %        74.84
    OPT   Shared is the highest-utilized pipeline (74.8%) based on elapsed cycles in the workload, taking into
    Registers Per Thread             register/thread             238
    Dynamic Shared Memory Per Block      Kbyte/block          230.82
    Achieved Occupancy                        %        12.42
  _merge(Params) (128, 1, 16)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Duration                         us        15.81
    DRAM Throughput                   %        65.67
    Dynamic Shared Memory Per Block       byte/block               64
"""


def test_ncu_gives_each_kernel_of_each_report_with_the_device_beside_them(tmp_path):
    (tmp_path / "def_a__ours__big.txt").write_text(NCU_REPORT)
    (tmp_path / "nvidia_smi.csv").write_text("name, clocks.current.sm [MHz]\nNVIDIA H100 80GB HBM3, 345 MHz\n")
    table, sources, hardware = et.build_ncu(str(tmp_path / "*.txt"))
    assert hardware == {"NVIDIA H100 80GB HBM3"} and len(sources) == 2
    assert rows(table) == [
        ["def_a", "ours", "big", "kernel_a", "1250.0", "72", "75", "Shared 74.8%", "2,1,66 x 256,1,1", "238",
         "230.8", "12"],
        ["def_a", "ours", "big", "_merge", "15.8", "66", "—", "—", "128,1,16 x 128,1,1", "—", "0.1", "—"]]  # bytes
    (tmp_path / "unnamed.txt").write_text(NCU_REPORT)
    with pytest.raises(et.FlashbenchError, match="not named DEFINITION__SOLUTION__WORKLOAD"):
        et.build_ncu(str(tmp_path / "*.txt"))
