"""A lossy copy of the KV caches kept across calls (docs/threat_model.md, class 4).

The queries are drawn whole on every call, but the KV caches change only by windows, and the worker
writes those: hooking `recipe.window_copies` in its own process tells it which rows changed. A
solution can keep an int8 copy of the rows its requests read (one scale per 32 values: about half the
bytes of bfloat16, and a decode call is bound by those bytes), refresh only the rows a window lands on,
and compute every call from the copy. The definition's tolerances must fail it: with an lse tolerance
of 1e-2 every call passed (lse off by 2e-3 to 6e-3); honest GPU solutions stay under 3e-4 on every
attention definition (committed traces).

Every call is checked as the CPU judge checks it (compare_outputs against the reference on the call's
own inputs, redrawn by InputSets as the worker and the judge redraw them).
"""

import math
from pathlib import Path

import torch

from flashbench import Repo
from flashbench.registry import find_root
from flashbench.run import recipe
from flashbench.run.judge.check import compare_outputs
from flashbench.run.judge.inputs import fresh_seed
from flashbench.run.protocol import Call
from flashbench.run.recipe import InputSets, output_link
from flashbench.workloads import generate_inputs, random_inputs

NAME = "mla_paged_decode_h16_ckv512_kpe64_ps1"
GROUP = 32  # int8 values per scale
SHORT = 512  # requests shorter than this are computed exactly from the cache (cheap anyway)


def _quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grouped = rows.float().view(rows.shape[0], -1, GROUP)
    scale = grouped.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127
    return torch.round(grouped / scale).to(torch.int8), scale


class Shadow:
    """int8 copies of the ckv and kpe rows the requests read, in kv_indices order."""

    def __init__(self, inputs: dict):
        self.ckv = inputs["ckv_cache"].reshape(-1, inputs["ckv_cache"].shape[-1])
        self.kpe = inputs["kpe_cache"].reshape(-1, inputs["kpe_cache"].shape[-1])
        self.pages = inputs["kv_indices"].long()
        self.rows_read = 0
        self.parts = [_quantize(self.ckv[self.pages]), _quantize(self.kpe[self.pages])]

    def refresh(self, windows: list[tuple[int, int]]) -> None:
        """Re-quantize the referenced rows a window (address, bytes) landed on; nothing else is read."""
        for which, table in enumerate((self.ckv, self.kpe)):
            base, row_bytes = table.data_ptr(), table.shape[1] * table.element_size()
            end = base + table.numel() * table.element_size()
            for address, nbytes in windows:
                low, high = max(address, base), min(address + nbytes, end)
                if low >= high:
                    continue
                first, last = (low - base) // row_bytes, (high - 1 - base) // row_bytes
                hit = ((self.pages >= first) & (self.pages <= last)).nonzero().flatten()
                if hit.numel():
                    values, scales = _quantize(table[self.pages[hit]])
                    self.parts[which][0][hit], self.parts[which][1][hit] = values, scales
                    self.rows_read += hit.numel()

    def decode(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        (cv, cs), (kv, ks) = self.parts
        ckv_all, kpe_all = (cv.float() * cs).flatten(1), (kv.float() * ks).flatten(1)
        q_nope, q_pe, bounds = inputs["q_nope"], inputs["q_pe"], inputs["kv_indptr"].tolist()
        output = torch.zeros(q_nope.shape, dtype=torch.bfloat16)
        lse = torch.full(q_nope.shape[:2], -math.inf)
        for b in range(q_nope.shape[0]):
            s, e = bounds[b], bounds[b + 1]
            if s == e:
                continue
            if e - s < SHORT:
                ckv, kpe = self.ckv[self.pages[s:e]].float(), self.kpe[self.pages[s:e]].float()
            else:
                ckv, kpe = ckv_all[s:e], kpe_all[s:e]
            logits = (q_nope[b].float() @ ckv.T + q_pe[b].float() @ kpe.T) * inputs["sm_scale"]
            natural = torch.logsumexp(logits, -1)
            output[b] = (torch.exp(logits - natural[:, None]) @ ckv).to(torch.bfloat16)
            lse[b] = natural / math.log(2.0)
        return output, lse


def test_a_lossy_kv_copy_kept_across_calls_fails_the_check(monkeypatch):
    repo = Repo(find_root(Path(__file__).parent))
    definition = repo.definition(NAME)
    workload = next(w for w in repo.workload_set(NAME).workloads if w.name == "b16_l8192")
    torch.manual_seed(0)
    sets = [generate_inputs(definition, workload, fresh_seed(), "cpu")]
    redraw = InputSets(definition, workload, sets, random_inputs(definition, workload))
    reference = repo.reference(NAME)

    windows: list[tuple[int, int]] = []
    window_copies = recipe.window_copies

    def recorded(*args):  # what a worker's solution can hook in its own process
        copies = window_copies(*args)
        windows.extend((target.data_ptr(), target.numel() * target.element_size()) for target, _ in copies)
        return copies

    monkeypatch.setattr(recipe, "window_copies", recorded)
    shadow = Shadow(sets[0])
    referenced = shadow.pages.numel()
    verdicts = []
    for _ in range(2):
        calls = [Call(set=0, slot=k, seed=fresh_seed()) for k in range(4)]
        redraw.draw(fresh_seed(), calls)
        link = None
        for k in range(len(calls)):
            redraw.redraw(k, link)
            redraw.flip(k, link)  # a CPU run's flush ("none") returns the link as given
            shadow.refresh(windows)
            windows.clear()
            output, lse = shadow.decode(sets[0])
            expected = dict(zip(definition.outputs, reference(*[sets[0][n] for n in definition.inputs])))
            verdicts.append(compare_outputs(definition, {"output": output, "lse": lse}, expected))
            link = int(output_link([output, lse]))
    calls_made = len(verdicts)
    # The shadow read a small share of the KV rows the calls read (the rest was skipped) ...
    assert shadow.rows_read < 0.05 * referenced * calls_made
    # ... so the judge must not pass it: a defence fails at least one of its calls.
    assert not all(v.passed for v in verdicts), [
        {n: round(e.max_abs_error, 4) for n, e in v.errors.items()} for v in verdicts]
