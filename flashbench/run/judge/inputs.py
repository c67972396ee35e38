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
from ..recipe import InputSets


def fresh_seed() -> int:
    return secrets.randbits(62)


class JobInputs:
    def __init__(self, definition: Definition, workload: Workload, set_seeds: list[int], device: str, base_dir: Path):
        self.definition = definition
        self.workload = workload
        self.device = device
        # The sets as drawn, which every job's arena starts from and the replay rewinds to, on the host: a GPU
        # then holds a job's inputs twice (the judge's current sets and the worker's arena), not three times
        # (on an 80 GB H100 the largest MHA varlen workloads did not fit so).
        self.sets = [{name: value.cpu() if isinstance(value, torch.Tensor) else value  # no copy on a CPU: read only
                      for name, value in generate_inputs(definition, workload, seed, device, base_dir).items()}
                     for seed in set_seeds]
        self.random_names = random_inputs(definition, workload)
        first = self.sets[0]
        self.tensors = {name: value for name, value in first.items() if isinstance(value, torch.Tensor)}
        self.scalars = {name: value for name, value in first.items() if not isinstance(value, torch.Tensor)}
        shapes = output_shapes(definition, bind_axes(definition, first))
        self.outputs = {name: (spec.dtype, shapes[name]) for name, spec in definition.outputs.items()}
        # What each set holds now, the calls made so far replayed on it; on the device.
        self.current = [_copied(s, device) for s in self.sets]
        self.replay = InputSets(definition, workload, self.current, self.random_names)
        self.redrawn_names = self.replay.redrawn_names  # random inputs, then generated data

    def drawn(self, index: int) -> dict:
        """Input set `index` as drawn, on the device."""
        return _copied(self.sets[index], self.device)


def _copied(inputs: dict, device: str) -> dict:
    return {name: value.to(device, copy=True) if isinstance(value, torch.Tensor) else value
            for name, value in inputs.items()}
