"""The H200 traces committed under traces/nvidia_h200 as a second data set: the boards built from
them agree with figures computed here by hand from the raw records."""

import json
import math
from pathlib import Path

import pytest

from flashbench import Repo
from flashbench.leaderboard import compare, leaderboards, solution_hashes

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "traces"
DECODE = "mla_paged_decode_h16_ckv512_kpe64_ps1"
PREFILL = "mla_paged_prefill_causal_h16_ckv512_kpe64_ps1"


def latencies(definition: str) -> dict[str, dict[str, float]]:
    """solution -> workload uuid -> latency_ms, the latest record of each pair, straight from JSON."""
    table: dict[str, dict[str, float]] = {}
    for line in (TRACES / "nvidia_h200" / f"{definition}.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["status"] == "PASSED":
            table.setdefault(record["solution"], {})[record["workload"]] = record["performance"]["latency_ms"]
    return table


def board_for(definition: str):
    repo = Repo(ROOT)
    (board,) = leaderboards(TRACES, definition, repo.workload_set(definition).workloads, hardware="nvidia_h200",
                            current_hashes=solution_hashes(repo, definition))  # as `flashbench leaderboard` builds it
    return board


@pytest.mark.parametrize("definition", [DECODE, PREFILL])
def test_every_h200_record_passed_and_is_counted(definition):
    board = board_for(definition)
    ranking = board.ranking.set_index("solution")
    workloads = len(Repo(ROOT).workload_set(definition).workloads)
    expected = {"reference", "torch_vectorized", "flashinfer_fa3"}
    expected |= {"triton_splitkv", "cuda_splitkv"} if definition == DECODE else {"triton_causal"}
    assert set(ranking.index) == expected
    ran = {solution: workloads for solution in expected}
    if definition == PREFILL:
        ran["torch_vectorized"] = workloads - 1  # its last workload did not fit the run's device time
    assert ranking["passed"].to_dict() == ran and (ranking["total"] == workloads).all()


def test_decode_figures_match_a_hand_computation():
    table = latencies(DECODE)
    board = board_for(DECODE)
    ranking = board.ranking.set_index("solution")
    assert board.baseline == "flashinfer_fa3"  # the faster of the two solutions tagged baseline
    smoke = {w.uuid for w in Repo(ROOT).workload_set(DECODE).workloads if "smoke" in w.tags}
    uuids = [u for u in table["reference"] if u not in smoke]  # smoke workloads check correctness only
    assert len(uuids) == len(table["reference"]) - 2

    def geomean(over: str, solution: str) -> float:
        ratios = [table[over][u] / table[solution][u] for u in uuids]
        return math.exp(sum(math.log(r) for r in ratios) / len(ratios))

    for solution in table:
        assert ranking.loc[solution, "speedup_vs_reference"] == pytest.approx(geomean("reference", solution), rel=1e-9)
        assert ranking.loc[solution, "speedup_vs_baseline"] == pytest.approx(geomean("flashinfer_fa3", solution), rel=1e-9)
    for solution in ("triton_splitkv", "cuda_splitkv"):
        wins = [u for u in uuids if table["flashinfer_fa3"][u] / table[solution][u] > 1.0]
        assert ranking.loc[solution, "fast_1.0"] == pytest.approx(len(wins) / len(uuids))
        assert ranking.loc[solution, "win_rate"] == pytest.approx(len(wins) / len(uuids))
    # every solution passed everything, so after the unranked reference the order is the geomean speedup over
    # the baseline
    by_hand = sorted(set(table) - {"reference"}, key=lambda solution: -geomean("flashinfer_fa3", solution))
    assert list(board.ranking["solution"]) == ["reference", *by_hand]


def test_compare_on_h200_decode_summarises_every_workload():
    comparison = compare(TRACES, DECODE, "flashinfer_fa3", "triton_splitkv",
                         Repo(ROOT).workload_set(DECODE).workloads, hardware="nvidia_h200")
    (only,) = comparison if isinstance(comparison, list) else [comparison]
    verdicts = only.table["verdict"].tolist()
    assert len(verdicts) == len(Repo(ROOT).workload_set(DECODE).workloads)
    assert "triton_splitkv" in only.summary
