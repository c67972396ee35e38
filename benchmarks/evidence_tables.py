"""The tables in docs/measurement.md, made from the data committed under docs/data/.

    python benchmarks/evidence_tables.py flush        # L2 flush methods (benchmarks/l2_flush.py --json)
    python benchmarks/evidence_tables.py clocks       # judge's clock, worker's events, earlier events traces
    python benchmarks/evidence_tables.py adversarial  # the GPU entries of the adversarial corpus
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data"
EARLIER = ROOT / "traces" / "nvidia_h200" / "mla_paged_decode_h16_ckv512_kpe64_ps1.jsonl"


def flush_table() -> str:
    records = json.loads((DATA / "l2_flush_h200.json").read_text())
    methods = list(dict.fromkeys(r["flush"] for r in records))
    rows = ["| kernel | " + " | ".join(f"after {m}" for m in methods) + " |", "|---|" + "---|" * len(methods)]
    for kernel in dict.fromkeys(r["kernel"] for r in records):
        cells = {r["flush"]: r["median_us"] for r in records if r["kernel"] == kernel}
        rows.append(f"| {kernel} | " + " | ".join(f"{cells[m]:.1f}" for m in methods) + " |")
    return "\n".join(rows)


def _traces(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def clocks_table() -> str:
    earlier = {(t["solution"], t["workload_name"]): t["performance"]["latency_ms"]
               for t in _traces(EARLIER) if t["status"] == "PASSED" and t["performance"]}
    rows = ["| solution | workload | earlier events (µs) | worker events (µs) | judge's clock (µs) | judge's 95% CI |",
            "|---|---|---|---|---|---|"]
    for trace in _traces(DATA / "decode_clocks_h200.jsonl"):
        key = (trace["solution"], trace["workload_name"])
        if trace["solution"] == "reference" or key not in earlier:
            continue
        clocks = trace["performance"]["crosscheck"] if trace["performance"] else None
        if trace["status"] != "PASSED":
            rows.append(f"| {key[0]} | {key[1]} | {earlier[key] * 1e3:.1f} | {trace['status']}: "
                        f"{trace['message'][:70]} | | |")
            continue
        perf = trace["performance"]
        worker = clocks.get("median_ms", clocks.get("worker", {}).get("latency_ms"))
        rows.append(f"| {key[0]} | {key[1]} | {earlier[key] * 1e3:.1f} | {worker * 1e3:.1f} | "
                    f"{perf['latency_ms'] * 1e3:.1f} | {perf['ci_low_ms'] * 1e3:.1f}-{perf['ci_high_ms'] * 1e3:.1f} |")
    return "\n".join(rows)


def adversarial_table() -> str:
    rows = ["| fixture | workload | status | message |", "|---|---|---|---|"]
    for trace in _traces(DATA / "adversarial_gpu_h200.jsonl"):
        if trace["solution"] != "reference":
            rows.append(f"| {trace['solution']} | {trace['workload_name']} | {trace['status']} | {trace['message'][:90]} |")
    return "\n".join(rows)


if __name__ == "__main__":
    tables = {"flush": flush_table, "clocks": clocks_table, "adversarial": adversarial_table}
    if len(sys.argv) != 2 or sys.argv[1] not in tables:
        sys.exit(f"usage: evidence_tables.py {{{'|'.join(tables)}}}")
    print(tables[sys.argv[1]]())
