"""The Python API (flashbench/api.py): the registry's listings, recorded results as a DataFrame, a run
returning its RunReport, and `best`, which loads the fastest recorded solution into this process
(or the reference) and calls it like the reference."""

import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashbench as fb
from flashbench import BindingError, FlashbenchError, Repo
from flashbench.api import hardware_of, run_options
from flashbench.run import RunOptions
from flashbench.leaderboard import solution_hashes
from flashbench.traces import append_trace, trace_path
from conftest import copy_repo
from trace_factory import make_trace

ROOT = Path(__file__).resolve().parents[1]
DECODE = "mla_paged_decode_h16_ckv512_kpe64_ps1"
FIXTURES = Path(__file__).parent / "fixtures" / "solutions" / DECODE
GPU = "GPU X"  # the hardware of hand-made traces

# Two solutions that are the reference under another name: a stand-in for a fast kernel, whose
# outputs are known. One writes into given outputs, one returns them.
DPS_KERNEL = """from reference_math import run as reference


def run(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, output, lse):
    computed = reference(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale)
    output.copy_(computed[0])
    lse.copy_(computed[1])
"""
RETURNING_KERNEL = "from reference_math import run\n"


def add_solution(root: Path, name: str, kernel: str, destination_passing: bool) -> Path:
    folder = root / "solutions" / DECODE / name
    folder.mkdir(parents=True)
    shutil.copy(root / "references" / "mla_paged" / f"{DECODE}.py", folder / "reference_math.py")
    (folder / "kernel.py").write_text(kernel)
    (folder / "solution.yaml").write_text(
        f"name: {name}\ndefinition: {DECODE}\nauthor: tests\nlanguage: python\nentry_point: kernel.py::run\n"
        f"destination_passing_style: {str(destination_passing).lower()}\n")
    return folder


@pytest.fixture(scope="module")
def root(module_repo) -> Path:
    add_solution(module_repo, "fast_dps", DPS_KERNEL, True)
    add_solution(module_repo, "fast_returning", RETURNING_KERNEL, False)
    return module_repo


@pytest.fixture(scope="module")
def registry(root) -> fb.Registry:
    return fb.load(root)


@pytest.fixture(scope="module")
def workloads(registry):
    return registry.workload_set(DECODE).workloads


def record(trace_dir: Path, *traces) -> Path:
    for trace in traces:
        append_trace(trace_path(trace_dir, trace.hardware, DECODE), trace)
    return trace_dir


def board_traces(registry, workloads, latencies: dict[str, float], status=None, solution_hash=None):
    """A trace per (solution, workload) on GPU X: the reference at 10 ms, others at their latency; the
    solutions' hashes those of their folders now, unless given."""
    hashes = solution_hashes(registry, DECODE)
    return [make_trace(solution, w.uuid, latency_ms=latency, status=(status or {}).get(solution, "PASSED"),
                       solution_hash=(solution_hash or hashes).get(solution, f"{solution}-hash"), definition=DECODE,
                       timestamp=f"2026-01-01T00:00:{i:02d}+00:00")
            for solution, latency in {"reference": 10.0, **latencies}.items() for i, w in enumerate(workloads)]


def decode_inputs(registry, workload) -> dict:
    return registry.inputs(DECODE, workload, seed=3)


# Importing and listing.

def test_importing_flashbench_loads_neither_the_api_nor_pandas():
    # A worker process imports this package: the API's names load on first use.
    code = ("import sys, flashbench; assert 'flashbench.api' not in sys.modules and 'pandas' not in sys.modules; "
            "flashbench.Registry; assert 'flashbench.api' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_fb_run_is_callable_and_still_the_run_package():
    import flashbench.run.runner as runner  # the form a function bound over the package would break

    assert callable(fb.run) and fb.run.Runner is runner.Runner


def test_a_registry_lists_definitions_solutions_and_workloads(registry, workloads):
    assert isinstance(registry, Repo) and registry.root == fb.Registry(registry.root).root
    assert [d.name for d in registry.definitions()] == registry.names()
    assert [s.name for s in registry.solutions("mla_paged_decode")] == ["fast_dps", "fast_returning"]
    assert registry.workloads(DECODE) == workloads
    assert [w.name for w in registry.workloads(DECODE, device="cpu")] == ["smoke_empty_short", "smoke_mixed"]
    assert [w.name for w in registry.workloads(DECODE, ["smoke_mixed"])] == ["smoke_mixed"]
    with pytest.raises(FlashbenchError, match="no workload matches 'huge'"):
        registry.workloads(DECODE, ["huge"])
    # one selector as a string is one selector (it was read character by character), and an empty one selects
    # nothing (every uuid starts with "": an unset variable selected every workload)
    assert [w.name for w in registry.workloads(DECODE, "smoke_mixed")] == ["smoke_mixed"]
    with pytest.raises(FlashbenchError, match="an empty workload selector selects nothing"):
        registry.workloads(DECODE, [""])


def test_a_workloads_inputs_in_the_definitions_order(registry, workloads):
    inputs = registry.inputs("mla_paged_decode", "smoke_mixed", seed=5)
    assert list(inputs) == list(registry.definition(DECODE).inputs)
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
               for a, b in zip(inputs.values(), registry.inputs(DECODE, workloads[1], seed=5).values()))
    with pytest.raises(FlashbenchError, match="'smoke' matches 2 workloads; name one"):
        registry.inputs(DECODE, "smoke")


# Recorded results.

def test_results_are_the_current_rows_with_stale_marked(registry, workloads, tmp_path):
    old = board_traces(registry, workloads[:2], {"fast_dps": 5.0}, solution_hash={"fast_dps": "old"})
    new = board_traces(registry, workloads[:2], {"fast_dps": 2.0, "fast_returning": 4.0})
    record(tmp_path, *old, *new, *[t.model_copy(update={"timestamp": "2026-01-02T00:00:00+00:00"}) for t in new[:1]])
    every = registry.results(DECODE, trace_dir=tmp_path, current=False)
    assert len(every) == 11 and every["stale"].tolist() == [True if h == "old" else False for h in every["solution_hash"]]
    current = registry.results("mla_paged_decode", GPU, trace_dir=tmp_path)
    assert len(current) == 6 and not current["stale"].any()  # the newest hash of each solution, the latest run
    assert sorted(current.loc[current["solution"] == "reference", "runs"]) == [2, 3]
    assert set(current.loc[current["solution"] == "fast_dps", "latency_ms"]) == {2.0}
    assert len(registry.results(DECODE, trace_dir=tmp_path, current=False, hide_stale=True)) == 9
    assert len(registry.traces(DECODE, GPU, trace_dir=tmp_path)) == 11 == len(registry.traces(DECODE, trace_dir=tmp_path))
    assert registry.traces(DECODE, "GPU Y", trace_dir=tmp_path) == []


# Running.

def test_run_returns_the_report_and_records_traces(root, tmp_path):
    seen = []
    report = fb.run("mla_paged_decode", solutions=[FIXTURES / "correct_dps"], workloads=["smoke_mixed"], device="cpu",
                    root=root, trace_dir=tmp_path, iters=2, warmup=0, timeout=60, on_result=seen.append)
    assert isinstance(report, fb.RunReport) and report.command == "run" and report.definition == DECODE
    assert [(r.solution, r.workload.name, r.status) for r in report.results] == [
        ("reference", "smoke_mixed", "PASSED"), ("correct_dps", "smoke_mixed", "PASSED")]
    assert (report.passed, report.failed, report.timing_method) == (2, 0, "host clock")
    assert [t.solution for t in seen] == ["reference", "correct_dps"]
    assert Path(report.trace_file).is_file() and Path(report.trace_file).is_relative_to(tmp_path)


def test_run_options_take_the_devices_defaults_and_refuse_what_does_not_fit():
    on_cpu = run_options("cpu")
    assert (on_cpu.device, on_cpu.warmup, on_cpu.iters, on_cpu.save) == ("cpu", 1, 5, True)
    assert run_options(devices="cpu:2").devices == ["cpu", "cpu"]
    with pytest.raises(FlashbenchError, match="give --device or --devices, not both"):
        run_options("cpu", devices="cpu:2")
    with pytest.raises(FlashbenchError, match="'tpu' is not a device flashbench runs on"):
        fb.load(ROOT).run(DECODE, device="tpu")
    with pytest.raises(TypeError):
        fb.load(ROOT).run(DECODE, device="cpu", iterations=3)


@pytest.mark.parametrize("option, field, message", [
    # each ran: the least count instead, every pair TIMEOUT "no answer within -5 s", or a flush no GPU knows
    ({"iters": 0}, "iters", "greater than or equal to 1"), ({"warmup": -1}, "warmup", "greater than or equal to 0"),
    ({"checked_calls": -1}, "checked_calls", "greater than or equal to 0"),
    ({"timeout": -5}, "timeout", "greater than 0"),
    ({"timeout": math.nan}, "timeout", "greater than 0"), ({"flush": "bogus"}, "flush", "no flush 'bogus'; known: read"),
])
def test_run_options_are_checked_as_the_cli_checks_them(option, field, message):
    with pytest.raises(FlashbenchError) as refused:
        run_options("cpu", **option)
    assert refused.value.field == field and message in refused.value.message
    options = run_options("cpu", timeout=math.inf)  # no time limit
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        options.iters = 0
    with pytest.raises(ValueError, match="iterations"):
        RunOptions(iterations=3)  # a misspelt option ran with the defaults


# best: the fastest recorded solution, loaded here, else the reference.

def test_without_traces_best_is_the_reference(registry, workloads, tmp_path):
    best = registry.best("mla_paged_decode", "cpu", trace_dir=tmp_path)
    assert (best.name, best.speedup, best.folder, best.hardware) == ("reference", None, None, hardware_of("cpu"))
    inputs = decode_inputs(registry, workloads[1])
    expected = registry.reference(DECODE)(*inputs.values())
    assert all(torch.equal(got, want) for got, want in zip(best(*inputs.values()), expected))
    # a hardware named that has no traces here is a typo or another machine's, not "no solution qualifies"
    with pytest.raises(FlashbenchError, match="no traces of hardware 'nvidia_h20' here"):
        registry.best("mla_paged_decode", "nvidia_h20", trace_dir=tmp_path)


def test_best_loads_the_fastest_and_calls_it_like_the_reference(registry, workloads, tmp_path):
    record(tmp_path, *board_traces(registry, workloads, {"fast_dps": 2.0, "fast_returning": 4.0}))
    best = fb.best("mla_paged_decode", GPU, root=registry.root, trace_dir=tmp_path)
    assert (best.name, best.hardware, best.destination_passing) == ("fast_dps", "gpu_x", True)
    assert best.speedup == pytest.approx(5.0) and best.folder == registry.root / "solutions" / DECODE / "fast_dps"
    inputs = decode_inputs(registry, workloads[1])
    expected = registry.reference(DECODE)(*inputs.values())
    output, lse = best(**inputs)  # by name; outputs allocated for the destination-passing solution
    assert torch.equal(output, expected[0]) and torch.equal(lse, expected[1])


def test_best_of_a_solution_that_returns_its_outputs(registry, workloads, tmp_path):
    record(tmp_path, *board_traces(registry, workloads, {"fast_dps": 6.0, "fast_returning": 4.0}))
    best = registry.best(DECODE, "gpu_x", trace_dir=tmp_path)
    assert best.name == "fast_returning" and not best.destination_passing
    inputs = decode_inputs(registry, workloads[0])
    assert all(torch.equal(got, want) for got, want in zip(best(*inputs.values()),
                                                           registry.reference(DECODE)(*inputs.values())))


@pytest.mark.parametrize("latencies, status, solution_hash", [
    ({"fast_dps": 20.0}, None, None),  # slower than the reference
    ({"fast_dps": 2.0}, {"fast_dps": "INCORRECT_NUMERICAL"}, None),  # failed every workload
    ({"fast_dps": 2.0}, None, {"fast_dps": "measured-other-content"}),  # stale: the folder changed since
    ({"imported": 2.0}, None, None),  # no folder here to load it from
])
def test_best_falls_back_to_the_reference(registry, workloads, tmp_path, latencies, status, solution_hash):
    record(tmp_path, *board_traces(registry, workloads, latencies, status, solution_hash))
    assert registry.best(DECODE, GPU, trace_dir=tmp_path).name == "reference"


def test_a_solution_that_failed_one_workload_is_not_the_best(registry, workloads, tmp_path):
    traces = board_traces(registry, workloads, {"fast_dps": 2.0, "fast_returning": 4.0})
    failed = next(t for t in traces if t.solution == "fast_dps" and t.workload == workloads[-1].uuid)
    traces[traces.index(failed)] = failed.model_copy(update={"status": "RUNTIME_ERROR", "performance": None})
    record(tmp_path, *traces)
    assert registry.best(DECODE, GPU, trace_dir=tmp_path).name == "fast_returning"


def test_smoke_latencies_count_only_when_asked(registry, workloads, tmp_path):
    smoke = [w for w in workloads if "smoke" in w.tags]
    record(tmp_path, *board_traces(registry, smoke, {"fast_dps": 2.0}))  # what a CPU run records
    assert registry.best(DECODE, GPU, trace_dir=tmp_path).name == "reference"
    assert registry.best(DECODE, GPU, trace_dir=tmp_path, include_smoke=True).name == "fast_dps"


def test_best_checks_its_inputs_against_the_definition(registry, workloads, tmp_path):
    best = registry.best(DECODE, "cpu", trace_dir=tmp_path)
    inputs = decode_inputs(registry, workloads[0])
    with pytest.raises(TypeError, match="missing a required argument: 'sm_scale'"):
        best(*list(inputs.values())[:-1])
    with pytest.raises(BindingError, match="q_nope: expected dtype bfloat16, got float32"):
        best(**{**inputs, "q_nope": inputs["q_nope"].float()})


def test_the_reference_of_a_sampling_definition_is_called_as_a_sampler(tmp_path):
    # Its reference returns distributions; called in place of a solution it must return samples.
    sampling_repo = Path(__file__).parent / "fixtures" / "sampling_repo"
    best = fb.best("top_k_sampling", "cpu", root=sampling_repo, trace_dir=tmp_path)
    inputs = fb.load(sampling_repo).inputs("top_k_sampling", "smoke_b32")
    samples = best(**inputs)
    assert best.name == "reference" and samples.dtype == torch.int64 and samples.shape == (32,)
    kept = fb.load(sampling_repo).reference("top_k_sampling")(**inputs)
    assert (kept.gather(1, samples[:, None]) > 0).all()


def test_best_on_a_gpu_this_machine_lacks_is_one_line(registry, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(FlashbenchError, match="^--device cuda: no CUDA device is visible"):
        registry.best(DECODE, "cuda")
    assert hardware_of("NVIDIA H200") == hardware_of("nvidia_h200") == "nvidia_h200"


def test_speedup_is_the_geomean_over_the_reference(registry, workloads, tmp_path):
    traces = board_traces(registry, workloads, {"fast_dps": 2.0})
    first_timed = next(w for w in workloads if "smoke" not in w.tags)
    slow = next(t for t in traces if t.solution == "fast_dps" and t.workload == first_timed.uuid)
    traces[traces.index(slow)] = make_trace("fast_dps", first_timed.uuid, latency_ms=8.0, definition=DECODE,
                                            solution_hash=slow.solution_hash)
    record(tmp_path, *traces)
    timed = [w for w in workloads if "smoke" not in w.tags]
    expected = math.exp((math.log(10 / 8) + (len(timed) - 1) * math.log(5)) / len(timed))
    assert registry.best(DECODE, GPU, trace_dir=tmp_path).speedup == pytest.approx(expected)


def test_the_documented_example_runs(tmp_path, monkeypatch):
    """docs/python_api.md's example, from the root of a copy of the repository with the solution and
    the H200 traces it reads."""
    copy = copy_repo(tmp_path / "repo")
    shutil.copytree(ROOT / "solutions" / DECODE / "torch_vectorized", copy / "solutions" / DECODE / "torch_vectorized")
    (copy / "traces" / "nvidia_h200").mkdir(parents=True)
    shutil.copy(ROOT / "traces" / "nvidia_h200" / f"{DECODE}.jsonl", copy / "traces" / "nvidia_h200")
    example = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "python_api.md").read_text(), re.S)[1]
    monkeypatch.chdir(copy)
    monkeypatch.delenv("FLASHBENCH_ROOT", raising=False)
    namespace = {}
    exec(compile(example, "docs/python_api.md", "exec"), namespace)
    assert [r.status for r in namespace["report"].results] == ["PASSED", "PASSED"]
    assert not namespace["results"].empty and namespace["output"].shape == (4, 16, 512)


def test_load_solution_gives_a_folders_entry_function(registry, workloads):
    function = registry.load_solution("mla_paged_decode", "fast_returning")  # a prefix of the definition
    inputs = decode_inputs(registry, workloads[0])
    assert all(torch.equal(got, want) for got, want in zip(function(*inputs.values()),
                                                           registry.reference(DECODE)(*inputs.values())))
    with pytest.raises(FlashbenchError, match="no solution 'missing' of .*; there are: .*fast_dps"):
        registry.load_solution(DECODE, "missing")
