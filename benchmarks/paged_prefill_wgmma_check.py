"""Checks the wgmma causal MLA paged prefill on a GPU against the repository's fp32 reference, then times it
beside FlashInfer's fa3 kernel.

    python benchmarks/paged_prefill_wgmma_check.py [SOLUTION] [--no-timing] [--skip-long]

Builds the solution folder SOLUTION (default `cuda_wgmma`) of mla_paged_prefill_causal_h16_ckv512_kpe64_ps1 as a
worker does (staged with its shared files, its own compile flags; `Registry.load_solution`) and runs it on
hand-made shapes: one request with q_len = kv_len = 5, a prefix cache (q_len < kv_len), single-token queries,
more queries than keys (rows that see no key), empty requests, 1500 requests of varied lengths, and one
request of 8192 tokens. kv_indices is a random permutation of the pool's pages, every page no request
references is NaN, and output / lse start as NaN (every row must be written). Output and lse are compared with
references/mla_paged/mla_paged_prefill_causal_h16_ckv512_kpe64_ps1.py under the definition's tolerances
(lse -inf exactly where the reference's is, output 0 there); one line PASS/FAIL per shape, and an exception
in one shape fails that shape only.

Then times ours and the `flashinfer_fa3` solution (when flashinfer imports) with `triton.testing.do_bench`
(its own L2 handling, not the harness's) on the definition's non-smoke workloads (inputs from
`generate_inputs`, seed 0), printing µs, TFLOP/s (the definition's cost model: visible pairs only) and
fa3 / ours. Exits 1 if any shape failed. A development check: the harness's verdicts and times are
`flashbench run`'s.
"""

import importlib.util
import math
import sys
import time
import traceback
from pathlib import Path

import torch

import flashbench as fb
from flashbench import generate_inputs
from flashbench.binding import bind_axes, output_shapes
from flashbench.dtypes import torch_dtype

ROOT = Path(__file__).resolve().parents[1]
DEFINITION = "mla_paged_prefill_causal_h16_ckv512_kpe64_ps1"
HEADS, DIM_CKV, DIM_KPE = 16, 512, 64
SCALE = 0.07216878364870322  # the workloads' sm_scale, 1 / sqrt(192)
OUT_ATOL, OUT_RTOL, LSE_ATOL = 1e-2, 2e-2, 1e-3  # the definition's tolerances


def reference_module():
    path = ROOT / "references" / "mla_paged" / f"{DEFINITION}.py"
    spec = importlib.util.spec_from_file_location("prefill_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_inputs(q_lens, kv_lens, spare_pages=37, seed=0):
    """Inputs on the GPU: pages a random permutation of a pool with spare pages, unreferenced pages NaN."""
    assert len(q_lens) == len(kv_lens)
    gen = torch.Generator().manual_seed(seed)
    qo = torch.tensor([0] + list(q_lens), dtype=torch.int64).cumsum(0).to(torch.int32)
    kv = torch.tensor([0] + list(kv_lens), dtype=torch.int64).cumsum(0).to(torch.int32)
    total_q, total_kv = int(qo[-1]), int(kv[-1])
    pages = total_kv + spare_pages
    indices = torch.randperm(pages, generator=gen)[:total_kv].to(torch.int32)
    ckv = torch.randn(pages, 1, DIM_CKV, generator=gen).to(torch.bfloat16)
    kpe = torch.randn(pages, 1, DIM_KPE, generator=gen).to(torch.bfloat16)
    unused = torch.ones(pages, dtype=torch.bool)
    unused[indices.long()] = False
    ckv[unused] = float("nan")
    kpe[unused] = float("nan")
    q_nope = torch.randn(total_q, HEADS, DIM_CKV, generator=gen).to(torch.bfloat16)
    q_pe = torch.randn(total_q, HEADS, DIM_KPE, generator=gen).to(torch.bfloat16)
    return [t.cuda() for t in (q_nope, q_pe, ckv, kpe, qo, kv, indices)]


def nan_outputs(total_q):
    return (torch.full((total_q, HEADS, DIM_CKV), float("nan"), dtype=torch.bfloat16, device="cuda"),
            torch.full((total_q, HEADS), float("nan"), dtype=torch.float32, device="cuda"))


def compare(out, lse, want_out, want_lse):
    """(ok, output max error, lse max error) under the definition's tolerances."""
    out, want_out = out.float(), want_out.float()
    out_err = (out - want_out).abs()
    ok = bool((out_err <= OUT_ATOL + OUT_RTOL * want_out.abs()).all())
    finite = torch.isfinite(want_lse)
    ok &= bool((torch.isfinite(lse) == finite).all())  # -inf exactly where the reference has it (and no NaN)
    ok &= bool((lse[~finite] == -math.inf).all())
    lse_err = (lse - want_lse).abs()[finite]
    ok &= bool((lse_err <= LSE_ATOL).all())
    lse_max = float(lse_err.nan_to_num(1e9).max()) if lse_err.numel() else 0.0
    return ok, float(out_err.nan_to_num(1e9).max()) if out_err.numel() else 0.0, lse_max


def check(run, reference, name, q_lens, kv_lens) -> bool:
    try:
        args = make_inputs(q_lens, kv_lens)
        out, lse = nan_outputs(args[0].shape[0])
        run(*args, SCALE, out, lse)
        torch.cuda.synchronize()
        want_out, want_lse = reference.run(*args, SCALE)
        ok, out_err, lse_err = compare(out, lse, want_out, want_lse)
        print(f"{'PASS' if ok else 'FAIL'} {name}: output max error {out_err:.4g}, lse max error {lse_err:.4g}",
              flush=True)
        return ok
    except Exception:
        print(f"FAIL {name}: exception", flush=True)
        traceback.print_exc()
        torch.cuda.synchronize()
        return False


def shapes(skip_long):
    gen = torch.Generator().manual_seed(1)
    many_q = [int(x) for x in torch.randint(1, 40, (1500,), generator=gen)]
    many_prefix = [int(x) for x in torch.randint(0, 300, (1500,), generator=gen)]
    mixed_q = [int(x) for x in torch.randint(64, 700, (16,), generator=gen)]
    mixed_prefix = [int(x) for x in torch.randint(0, 1500, (16,), generator=gen)]
    cases = [
        ("b1 q5 kv5", [5], [5]),
        ("b1 q1 kv1", [1], [1]),
        ("b1 q3 kv130 (prefix)", [3], [130]),
        ("b1 q64 kv64", [64], [64]),
        ("b1 q100 kv1000 (prefix)", [100], [1000]),
        ("b4 q1 (single-token queries)", [1, 1, 1, 1], [1, 64, 65, 300]),
        ("b2 q9 kv4 / q70 kv3 (more queries than keys)", [9, 70], [4, 3]),
        ("b5 with empty requests", [0, 6, 12, 0, 3], [4, 0, 200, 0, 3]),
        ("b3 q17 kv150 / q2 kv2 / q13 kv77", [17, 2, 13], [150, 2, 77]),
        ("b16 mixed (q 64-700, prefix 0-1500)", mixed_q, [q + p for q, p in zip(mixed_q, mixed_prefix)]),
        ("b1500 varied (q 1-39, prefix 0-299)", many_q, [q + p for q, p in zip(many_q, many_prefix)]),
    ]
    if not skip_long:
        cases.append(("b1 q8192 kv8192", [8192], [8192]))
    return cases


def workload_args(repo, definition, workload):
    made = generate_inputs(definition, workload, 0, "cuda", repo.definition_path(DEFINITION).parent)
    args = [made[name] for name in definition.inputs]
    outs = output_shapes(definition, bind_axes(definition, made))
    return args + [torch.empty(shape, dtype=torch_dtype(definition.outputs[name].dtype), device="cuda")
                   for name, shape in outs.items()]


def visible_pairs(qo_indptr, kv_indptr):
    q = (qo_indptr[1:] - qo_indptr[:-1]).double()
    k = (kv_indptr[1:] - kv_indptr[:-1]).double()
    return float((q * k - q * (q - 1) / 2).sum())


def timings(run) -> None:
    from triton.testing import do_bench

    repo = fb.load(ROOT)
    definition = repo.definition(DEFINITION)
    try:
        import flashinfer  # noqa: F401
        fa3 = repo.load_solution(DEFINITION, "flashinfer_fa3")
    except Exception as exc:  # no flashinfer here: time ours alone
        print(f"flashinfer_fa3 unavailable ({exc!r}); timing ours alone", flush=True)
        fa3 = None
    for workload in repo.workload_set(DEFINITION).workloads:
        if "smoke" in workload.tags:
            continue
        try:
            args = workload_args(repo, definition, workload)
            flops = 2 * HEADS * (DIM_CKV + DIM_KPE + DIM_CKV) * visible_pairs(args[4].cpu(), args[5].cpu())
            ours = do_bench(lambda: run(*args), warmup=50, rep=300)
            line = f"{workload.name}: ours {ours * 1e3:.1f} us ({flops / ours / 1e9:.0f} TFLOP/s)"
            if fa3 is not None:
                mine = args[-2].clone(), args[-1].clone()
                fa3(*args)
                theirs = do_bench(lambda: fa3(*args), warmup=50, rep=300)
                finite = torch.isfinite(mine[1])
                diff = (mine[0].float() - args[-2].float()).abs().max()
                lse_diff = (mine[1] - args[-1]).abs()[finite].max() if finite.any() else 0.0
                line += (f"; fa3 {theirs * 1e3:.1f} us; fa3/ours {theirs / ours:.2f}x; max difference output "
                         f"{diff:.3g}, lse {float(lse_diff):.3g}")
            print(line, flush=True)
        except Exception:
            print(f"{workload.name}: exception", flush=True)
            traceback.print_exc()


def main(argv) -> int:
    name = next((arg for arg in argv if not arg.startswith("--")), "cuda_wgmma")
    started = time.time()
    reference = reference_module()
    run = fb.load(ROOT).load_solution(DEFINITION, name)
    print(f"built {name} in {time.time() - started:.0f} s", flush=True)
    results = [check(run, reference, *case) for case in shapes("--skip-long" in argv)]
    if "--no-timing" not in argv:
        timings(run)
    failed = results.count(False)
    print("ALL PASS" if failed == 0 else f"{failed} of {len(results)} shapes FAILED", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
