"""benchmarks/fuzz_workloads.py: the random workloads it appends are valid for their definitions (inputs
generated and bound, as `flashbench validate` does) and the same seed gives the same workloads."""

import importlib.util
import json
import shutil
from pathlib import Path

import yaml

from flashbench.registry import Repo
from flashbench.validate import validate

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("fuzz_workloads", ROOT / "benchmarks" / "fuzz_workloads.py")
fuzz = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz)


def fuzzed_copy(tmp_path: Path, monkeypatch, seed: int, per: int = 1) -> Path:
    """A copy of the repository's definitions (and the references they name) with `per` random workloads
    appended to each set."""
    for folder in ("definitions", "references"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    monkeypatch.setattr(fuzz, "DEFINITIONS", tmp_path / "definitions")
    fuzz.main(seed, per)
    return tmp_path


def fuzz_workloads(root: Path) -> dict[str, list[dict]]:
    return {path.name: [w for w in yaml.safe_load(path.read_text())["workloads"] if "fuzz" in w.get("tags", [])]
            for path in sorted((root / "definitions").glob("*/*.workloads.yaml"))}


def test_every_appended_workload_is_valid(tmp_path, monkeypatch):
    root = fuzzed_copy(tmp_path, monkeypatch, seed=3)
    appended = {name: found for name, found in fuzz_workloads(root).items() if found}
    assert len(appended) == 14 and sorted(len(found) for found in appended.values()) == [1] * 10 + [2] * 4
    assert sum(w["name"] == "fuzz_empty" for found in appended.values() for w in found) == 4
    files = [path for path in (root / "definitions").glob("*/*.workloads.yaml") if path.name in appended]
    checked = validate(Repo(root), files)
    assert [c.error for c in checked if not c.ok] == []
    assert len(checked) == 14


def test_a_second_sweep_of_another_seed_in_one_copy_keeps_names_unique(tmp_path, monkeypatch):
    """Workload sets refuse a name twice: a second sweep's workloads are numbered on, its empty batch named by seed."""
    root = fuzzed_copy(tmp_path, monkeypatch, seed=3)
    fuzz.main(4, 1)
    decode = fuzz_workloads(root)["mla_paged_decode_h16_ckv512_kpe64_ps1.workloads.yaml"]
    assert [w["name"] for w in decode] == ["fuzz0", "fuzz_empty", "fuzz1", "fuzz_empty_4"]
    assert Repo(root).workload_set("mla_paged_decode_h16_ckv512_kpe64_ps1") is not None


def test_the_same_seed_gives_the_same_workloads(tmp_path, monkeypatch):
    first = fuzz_workloads(fuzzed_copy(tmp_path / "a", monkeypatch, seed=5))
    second = fuzz_workloads(fuzzed_copy(tmp_path / "b", monkeypatch, seed=5))
    other = fuzz_workloads(fuzzed_copy(tmp_path / "c", monkeypatch, seed=6))
    assert first == second and first != other



def test_seed_11_gives_the_workloads_of_the_committed_sweep(tmp_path, monkeypatch):
    """docs/peers.md's sweep resumed across versions of the tool: seed 11 still gives every workload its traces
    name (a change to the draws would orphan them)."""
    drawn = {w["uuid"] for found in fuzz_workloads(fuzzed_copy(tmp_path, monkeypatch, seed=11, per=4)).values()
             for w in found}
    traced = {json.loads(line)["workload"] for path in (ROOT / "docs/data/fuzz_h100").glob("*.jsonl")
              for line in path.read_text().splitlines()}
    assert len(traced) > 40 and traced <= drawn
