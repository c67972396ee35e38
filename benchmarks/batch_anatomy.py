"""Where a batch's time goes on a GPU: the harness's loop (redraw, L2 flush, call, link) run in one process
with host timestamps and CUDA events, with and without a device-side wait before the flush, and
with and without idle gaps between batches. For each: wall time per call, host time to issue the
calls, device span, the call's own events, the same batch without the call (the baseline), and
their difference (what a judge's clock would read).

    python benchmarks/batch_anatomy.py triton_splitkv,cuda_splitkv b1_l1024,b16_l8192,b128_l8192

Output as in docs/data/clock_study_h200/batch_anatomy.txt (times in µs per call).
"""
import statistics, sys, time
from pathlib import Path
import torch
from flashbench import Repo
from flashbench.binding import bind_axes, output_shapes
from flashbench.build import load_entry_point
from flashbench.dtypes import torch_dtype
from flashbench.run import select_solutions, select_workloads
from flashbench.run.protocol import Call
from flashbench.run.recipe import L2Flush, InputSets, output_link
from flashbench.workloads import generate_inputs, random_inputs

repo = Repo(Path("."))
name = repo.resolve("mla_paged_decode")
d = repo.definition(name)
wls = {w.name: w for w in select_workloads(repo, name, [], "cuda")}
flush = L2Flush("write+read", "cuda")
N = 80

def run(entry, sets_inp, outs, lead_cycles, call=True):
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(N)]; ends = [torch.cuda.Event(enable_timing=True) for _ in range(N)]
    torch.cuda.synchronize()
    t0 = time.perf_counter(); ev0.record()
    sets_inp.draw(12345, [Call(set=0, slot=0, seed=1000 + k) for k in range(N)])
    t_draw = time.perf_counter()
    link = None
    for k in range(N):
        sets_inp.redraw(k, link)
        if lead_cycles: torch.cuda._sleep(lead_cycles)
        flush()
        starts[k].record()
        if call: entry(*args(sets_inp), *outs)
        ends[k].record()
        link = output_link(outs)  # the next call's redraw depends on these outputs, as in the harness
    t_issued = time.perf_counter()
    ev1.record(); torch.cuda.synchronize(); t1 = time.perf_counter()
    calls = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return dict(wall=(t1 - t0) * 1e3 / N, issue=(t_issued - t0) * 1e3 / N, draw=(t_draw - t0) * 1e3, span=ev0.elapsed_time(ev1) / N,
                call=statistics.median(calls))

def args(s):
    t = s.sets[0]
    return [t[n] if n in t else scal[n] for n in d.inputs]

for sol in sys.argv[1].split(","):
    folder = select_solutions(repo, name, [sol])[0]
    entry = load_entry_point(folder.path, folder.solution, Path(".flashbench-cache"))
    for wname in sys.argv[2].split(","):
        w = wls[wname]
        inp = generate_inputs(d, w, 7, "cuda", Path("."))
        scal = {k: v for k, v in inp.items() if not isinstance(v, torch.Tensor)}
        sets_inp = InputSets(d, w, [{k: v for k, v in inp.items() if isinstance(v, torch.Tensor)}], random_inputs(d, w))
        shapes = output_shapes(d, bind_axes(d, inp))
        outs = [torch.empty(shapes[o], dtype=torch_dtype(spec.dtype), device="cuda") for o, spec in d.outputs.items()]
        for k in range(3): entry(*args(sets_inp), *outs)
        for lead in (0, 200_000, 500_000):
            for gap in (0.0, 0.1):
                rs, bs = [], []
                for rep in range(4):
                    time.sleep(gap); rs.append(run(entry, sets_inp, outs, lead))
                    time.sleep(gap); bs.append(run(entry, sets_inp, outs, lead, call=False))
                med = lambda xs, key: statistics.median(x[key] for x in xs) * 1e3
                print(f"{sol:15s} {wname:12s} lead {lead:7d} gap {gap:.1f}: wall {med(rs,'wall'):7.1f} issue {med(rs,'issue'):7.1f} "
                      f"span {med(rs,'span'):7.1f} call-ev {med(rs,'call'):6.1f} | base wall {med(bs,'wall'):7.1f} issue {med(bs,'issue'):7.1f} "
                      f"span {med(bs,'span'):7.1f} | judge {med(rs,'wall')-med(bs,'wall'):7.1f} draw {med(rs,'draw'):.0f}us"
                      f" spread {min(r['wall'] for r in rs)*1e3:.1f}-{max(r['wall'] for r in rs)*1e3:.1f}", flush=True)
