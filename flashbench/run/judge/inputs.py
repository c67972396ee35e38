"""A job's inputs, made by the judge from seeds only it knows.

Each input set starts from a run seed (its random inputs and the data generators make, such as
FP8 KV caches; index structure is the workload's own); every later call first redraws part of its
set's data inputs, random and generated (run/recipe.py InputSets), from seeds drawn for its batch
and for the call, revealed to the worker only in the batch that makes it. So no output can be
computed ahead of its batch, and no cache of earlier calls can answer one. The judge replays the
same redraws on copies of its own, so it knows the inputs of every call (for the reference) and
what the worker's sets must hold after each batch.
"""

import secrets
from pathlib import Path

import torch

from ...binding import bind_axes, output_shapes
from ...model import Definition, Workload
from ...workloads import generate_inputs, random_inputs
from ...workloads.tensors import input_set_bytes, job_bytes, outputs_bytes
from ..recipe import InputSets


def fresh_seed() -> int:
    return secrets.randbits(62)


class JobInputs:
    def __init__(self, definition: Definition, workload: Workload, set_seeds: list[int], device: str, base_dir: Path,
                 budget_bytes: int | None = None):
        """The sets of the first seeds, as many as `budget_bytes` holds (sets_within; all without a budget)."""
        self.definition = definition
        self.workload = workload
        self.device = device

        def drawn(seed: int) -> tuple[dict, dict]:
            # The set as drawn, on the device, becomes the judge's current copy; a copy of it on the host is what the
            # replay rewinds to: a GPU then holds a job's inputs twice (the judge's current sets and the worker's
            # arena), not three times (on an 80 GB H100 the largest MHA varlen workloads did not fit so), and each
            # set crosses to the host once, never back (a 1.2 GB decode set took about 0.5 s a crossing on an H100).
            made = generate_inputs(definition, workload, seed, device, base_dir)
            return ({name: value.to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
                     for name, value in made.items()}, made)

        first, first_current = drawn(set_seeds[0])
        self.random_names = random_inputs(definition, workload)
        self.tensors = {name: value for name, value in first.items() if isinstance(value, torch.Tensor)}
        self.scalars = {name: value for name, value in first.items() if not isinstance(value, torch.Tensor)}
        shapes = output_shapes(definition, bind_axes(definition, first))
        self.outputs = {name: (spec.dtype, shapes[name]) for name, spec in definition.outputs.items()}
        self.output_bytes = outputs_bytes(self.outputs)
        count = len(set_seeds) if budget_bytes is None else sets_within(
            budget_bytes, len(set_seeds), input_set_bytes(self.tensors), self.output_bytes)
        rest = [drawn(seed) for seed in set_seeds[1:count]]
        self.sets = [first] + [host for host, _ in rest]
        # What each set holds now, the calls made so far replayed on it; on the device.
        self.current = [first_current] + [current for _, current in rest]
        self.replay = InputSets(definition, workload, self.current, self.random_names)
        self.redrawn_names = self.replay.redrawn_names  # random inputs, then generated data

    def drawn(self, index: int) -> dict:
        """Input set `index` as drawn, on the device."""
        return _copied(self.sets[index], self.device)


def sets_within(budget_bytes: int, asked: int, set_bytes: int, output_bytes: int) -> int:
    """The most input sets, at most `asked` and at least one, whose device memory (job_bytes) fits the budget."""
    for count in range(asked, 1, -1):
        if job_bytes(count, set_bytes, output_bytes) <= budget_bytes:
            return count
    return 1


def _copied(inputs: dict, device: str) -> dict:
    return {name: value.to(device, copy=True) if isinstance(value, torch.Tensor) else value
            for name, value in inputs.items()}
