"""The FlashMLA-form decode and varlen MHA prefill solutions, on the CPU.

Every solution folder of the four definitions (a Triton kernel, under Triton's interpreter, and a
plain PyTorch baseline) runs on each smoke workload of its definition. Two ways (solution_checks.py
says why): one child process calls each entry point, loaded as the runner's worker loads it, once on
every smoke workload (the prefill ones with fewer heads: NARROW), outputs poisoned and judged by the
definition's evaluator; and every kernel runs through the runner, as `flashbench run` would (in its
worker process: inputs generated from the workload, outputs poisoned before each call, checked
against the reference with the definition's tolerances, a repeated call and timed calls checked
too), on its definition's first smoke workload cut down to one short request (RUNNER_CUTS). The two
decode definitions (16 and 128 heads) share their kernels, as do the two prefill ones (key
dimensions 128 and 192): the runner runs each kernel for one of them. The smoke workloads cover
split and unsplit decode, one and two draft tokens, table slots of -1, and prefill tiles after a
prefix, on the diagonal, and a sequence without queries. Generated caches hold finite values
everywhere, so the same child process also runs the Triton decode kernels on a cache whose slots
past each request's length are NaN (the definition says they may hold anything), and every
solution on workloads without queries (EMPTY_CUTS), which the schema allows and the references answer
with empty outputs.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from flashbench import Repo
from flashbench.run import select_solutions, select_workloads
from solution_checks import (SOLUTIONS, check_directly, cut_down, interpreted, kernel_of, load_module, nan_tail_case,
                             run_through_runner, solution_file)

ROOT = Path(__file__).resolve().parents[2]
DEFINITIONS = {
    "flashmla_decode_causal_h128_ckv512_kpe64_ps64": {"triton_splitkv", "triton_balanced", "triton_flat",
                                                      "torch_vectorized"},
    "flashmla_decode_causal_h16_ckv512_kpe64_ps64": {"triton_splitkv", "triton_balanced", "triton_flat",
                                                      "torch_vectorized"},
    "mha_varlen_prefill_causal_h128_dqk128_dv128": {"triton_fa2", "torch_vectorized"},
    "mha_varlen_prefill_causal_h128_dqk192_dv128": {"triton_fa2", "torch_vectorized"},
}
PEER_BASELINES = {"flashmla", "flashinfer_fa3"}
# Through the runner: every folder of these definitions, among them one folder of each kernel (as
# test_every_kernel_goes_through_the_runner checks): decode with 16 heads (the interpreter's cost grows
# with the heads), prefill with the key dimension split in two dots (192 = 128 + 64).
THROUGH_RUNNER = ["flashmla_decode_causal_h16_ckv512_kpe64_ps64", "mha_varlen_prefill_causal_h128_dqk192_dv128"]

# The runner's workload, per generator: the first smoke workload with these fields. Decode: one
# request of one token in a cache of two blocks (its table slots past the first are -1; under the
# interpreter the decode kernels still split it and merge; the judge redraws the whole cache before
# every call and six times more per timed batch for its baseline); prefill: one query after a prefix
# of two keys (128 heads are 128 programs of the interpreter however short the sequence).
RUNNER_CUTS = {
    "block_table": {"seqlens": [1], "block_pool": 2},
    "varlen": {"q_lens": [1], "prefix_lens": [2]},
}

# The direct calls of the prefill solutions use 8 of the 128 heads: triton_fa2's programs each own one
# head and a query tile, so 8 heads run the code of 128 at a sixteenth of the interpreter's cost (the
# runner's calls use all 128).
NARROW = {definition: {"num_heads": 8, "num_heads_kv": 8}
          for definition in DEFINITIONS if definition.startswith("mha_")}


# Workloads without queries, per generator: the first smoke workload with these fields. Decode:
# seq_len_q 0, one request without keys; prefill: every sequence without queries or keys, and an
# empty sequence after one with queries.
EMPTY_CUTS = {
    "block_table": {"no_queries": dict(axes={"seq_len_q": 0}, seqlens=[0, 5])},
    "varlen": {"all_empty": dict(q_lens=[0, 0], prefix_lens=[0, 0]),
               "empty_last": dict(q_lens=[2, 0], prefix_lens=[1, 0])},
}
EMPTY = "workloads without queries"  # their key among the child's results


def runner_workload(repo: Repo, definition: str):
    first = select_workloads(repo, definition, [], "cpu")[0]
    return cut_down(first, **RUNNER_CUTS[first.generate[0].generator])


def empty_workloads(repo: Repo, definition: str) -> list:
    first = select_workloads(repo, definition, [], "cpu")[0]
    return [cut_down(first, name=name, **fields) for name, fields in EMPTY_CUTS[first.generate[0].generator].items()]


@pytest.fixture(scope="module")
def direct_results(tmp_path_factory):
    return interpreted(__file__, "--direct", tmp_path_factory.mktemp("direct") / "results.json")


def solution_folders(repo: Repo, definition: str) -> list:
    # CUDA solutions need a GPU; tests/solutions/test_cuda_solutions.py compiles them. The peer
    # libraries' wrappers (FlashMLA, FlashInfer) run on a GPU only: tests/solutions/test_peer_baselines.py.
    return [f for f in select_solutions(repo, definition, [])
            if f.solution.language != "cuda" and f.solution.name not in PEER_BASELINES]


def test_every_kernel_goes_through_the_runner():
    repo = Repo(ROOT)
    folders = {d: solution_folders(repo, d) for d in DEFINITIONS}
    assert {d: {f.solution.name for f in found} for d, found in folders.items()} == DEFINITIONS
    kernels = {(d, f.solution.name): kernel_of(f) for d, found in folders.items() for f in found}
    through_runner = {kernel for (d, _), kernel in kernels.items() if d in THROUGH_RUNNER}
    left_out = [pair for pair, kernel in kernels.items() if kernel not in through_runner]
    assert not left_out, left_out


@pytest.mark.parametrize("definition", THROUGH_RUNNER)
def test_solutions_pass_through_the_runner(definition, tmp_path):
    repo = Repo(ROOT)
    folders = solution_folders(repo, definition)
    assert {f.solution.name for f in folders} == DEFINITIONS[definition]
    workload = runner_workload(repo, definition)
    traces = run_through_runner(definition, folders, [workload], tmp_path)
    ran = sorted((t.solution, t.workload_name) for t in traces)
    assert ran == [(name, workload.name) for name in sorted(DEFINITIONS[definition])]
    failed = {(t.solution, t.workload_name): f"{t.status}: {t.message} {t.log[-600:]}"
              for t in traces if t.status != "PASSED"}
    assert not failed, failed


@pytest.mark.parametrize("definition", list(DEFINITIONS))
def test_solutions_pass_the_smoke_workloads(definition, direct_results):
    workloads = select_workloads(Repo(ROOT), definition, [], "cpu")
    assert workloads and all("smoke" in w.tags for w in workloads)
    # The reference itself is checked against float64 in tests/test_flashmla_references.py.
    expected = {f"{definition}/{solution}/{w.name}" for solution in DEFINITIONS[definition] for w in workloads}
    results = {key: value for key, value in direct_results.items() if key.startswith(f"{definition}/")}
    assert set(results) == expected
    failed = {key: value["problems"] for key, value in results.items() if value["problems"]}
    assert not failed, failed


@pytest.mark.parametrize("definition", list(DEFINITIONS))
def test_solutions_pass_workloads_without_queries(definition, direct_results):
    names = [w.name for w in empty_workloads(Repo(ROOT), definition)]
    expected = {f"{definition}/{solution}/{name}" for solution in DEFINITIONS[definition] for name in names}
    results = {key: value for key, value in direct_results[EMPTY].items() if key.startswith(f"{definition}/")}
    assert set(results) == expected
    failed = {key: value["problems"] for key, value in results.items() if value["problems"]}
    assert not failed, failed


DECODE_H16 = "flashmla_decode_causal_h16_ckv512_kpe64_ps64"
NAN_TAILS = "decode kernels on NaN block tails"  # its key among the child's results



def check_decode_on_nan_tails() -> dict:
    """In the child process, under the interpreter: the Triton kernels, with and without splits
    (triton_balanced with one unit in all, and with units cut to 64 keys so every request splits, and with
    its chunk grown until 4 units hold all (its default), and without that fit (6 units at lengths 2, 70, 129);
    triton_splitkv with half-block key tiles; triton_flat with ranges that cross requests, with one token's
    rows a tile, and with its floor on blocks a program, which gives one program all six blocks)."""
    reference = load_module("decode_reference", ROOT / Repo(ROOT).definition(DECODE_H16).reference)
    splitkv = load_module("decode_triton", solution_file(DECODE_H16, "triton_splitkv", "splitkv.py"),
                          SOLUTIONS / DECODE_H16 / "triton_splitkv")
    balanced = load_module("decode_balanced", solution_file(DECODE_H16, "triton_balanced", "balanced.py"),
                           SOLUTIONS / DECODE_H16 / "triton_balanced")
    flat = load_module("decode_flat", solution_file(DECODE_H16, "triton_flat", "flat.py"),
                       SOLUTIONS / DECODE_H16 / "triton_flat")
    variants = {"splitkv 1": (splitkv, {"num_splits": 1}), "splitkv 3": (splitkv, {"num_splits": 3}),
                "balanced 1": (balanced, {"target_units": 1}),
                "balanced 64-key units": (balanced, {"target_units": 8, "min_chunk": 64}),
                "balanced fitted to 4 units": (balanced, {"target_units": 4, "min_chunk": 64}),
                "balanced unfitted, 6 units": (balanced, {"target_units": 4, "min_chunk": 64, "fit": False}),
                "splitkv half blocks": (splitkv, {"num_splits": 3, "block_n": 32}),
                **{f"flat {n} programs": (flat, {"programs": n, "min_blocks": 1}) for n in (1, 2, 5)},
                "flat 16-row tiles, 32-column merge": (flat, {"programs": 5, "min_blocks": 1, "block_m": 16,
                                                             "merge_columns": 32}),
                "flat at least 8 blocks a program": (flat, {"programs": 5})}
    inputs = nan_tail_case()
    ref_out, ref_lse = reference.run(*inputs)
    errors = {}
    for name, (kernel, options) in variants.items():
        out = torch.full_like(ref_out, float("nan"))
        lse = torch.full_like(ref_lse, float("nan"))
        kernel.launch(*inputs, out, lse, **options)
        errors[name] = [(out.float() - ref_out.float()).abs().max().item(), (lse - ref_lse).abs().max().item()]
    return errors


def test_triton_decode_ignores_block_tails(direct_results):
    errors = direct_results[NAN_TAILS]
    assert len(errors) == 12
    for variant, (out_error, lse_error) in errors.items():
        assert out_error <= 2e-2 and lse_error <= 1e-3, (variant, out_error, lse_error)  # NaN fails too


def test_torch_decode_ignores_block_tails():
    reference = load_module("decode_reference", ROOT / Repo(ROOT).definition(DECODE_H16).reference)
    kernel = load_module("decode_torch", solution_file(DECODE_H16, "torch_vectorized"))
    inputs = nan_tail_case()
    ref_out, ref_lse = reference.run(*inputs)
    out, lse = kernel.run(*inputs)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=1e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=1e-3)


if __name__ == "__main__" and "--direct" in sys.argv:
    pairs = [(definition, solution) for definition, solutions in DEFINITIONS.items() for solution in sorted(solutions)]
    results = Path(sys.argv[-1])
    checked = check_directly(pairs, results.parent / "staged", narrow=NARROW)
    checked[NAN_TAILS] = check_decode_on_nan_tails()
    checked[EMPTY] = check_directly(pairs, results.parent / "staged", narrow=NARROW,
                                    workloads={d: empty_workloads(Repo(ROOT), d) for d in DEFINITIONS})
    results.write_text(json.dumps(checked))
