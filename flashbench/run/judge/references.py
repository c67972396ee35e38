"""Reference outputs, computed by the judge (the reference is trusted code) and kept in memory only.

Inputs come from seeds drawn for each run, so there is nothing to cache across runs and nothing
on disk a solution could poison. Within a run the outputs of each workload's input sets are kept
(least recently used dropped past a memory budget), so every solution is checked against the
same computation.
"""

import threading
from collections import OrderedDict
from typing import Callable

import torch

from ...model import Definition
from . import evaluators

Outputs = dict[str, torch.Tensor]


class ReferenceStore:
    def __init__(self, definition: Definition, reference: Callable, budget_bytes: int):
        self.definition = definition
        self.reference = reference
        self.budget_bytes = budget_bytes
        self._kept: OrderedDict[tuple, Outputs] = OrderedDict()
        self._lock = threading.Lock()

    def kept(self, key: tuple, inputs: Callable[[], dict]) -> Outputs:
        """The outputs for `key` (e.g. a workload and a set's seed), computed once while they fit."""
        with self._lock:
            if key in self._kept:
                self._kept.move_to_end(key)
                return self._kept[key]
        outputs = self.compute(inputs())
        with self._lock:
            self._kept[key] = outputs
            self._evict(keep=key)
        return outputs

    def compute(self, inputs: dict) -> Outputs:
        """CPU copies of the reference's outputs on `inputs`; on the host when the device has no
        memory left for it (a worker may hold it all)."""
        try:
            return self._compute(inputs)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            return self._compute({name: v.cpu() if isinstance(v, torch.Tensor) else v for name, v in inputs.items()})

    def _compute(self, inputs: dict) -> Outputs:
        if evaluators.samples_reference(self.definition):  # a sampling reference: several draws, and scores
            return evaluators.reference_samples(self.definition, self.reference, inputs)
        with torch.no_grad():
            returned = self.reference(*[inputs[name] for name in self.definition.inputs])
        if not isinstance(returned, (tuple, list)):
            returned = (returned,)
        return {name: t.detach().to("cpu").contiguous() for name, t in zip(self.definition.outputs, returned)}

    def _evict(self, keep: tuple) -> None:
        held = sum(_nbytes(outputs) for outputs in self._kept.values())
        for key in list(self._kept):
            if held <= self.budget_bytes:
                break
            if key != keep:
                held -= _nbytes(self._kept.pop(key))


def _nbytes(outputs: Outputs) -> int:
    return sum(t.numel() * t.element_size() for t in outputs.values())
