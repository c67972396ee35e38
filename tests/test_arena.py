"""The arena: what the judge writes there, a worker's mapping sees, and what the worker writes the judge reads."""

import subprocess
import sys

import pytest
import torch

from flashbench.run.arena import Arena, open_file_arena, plan_layout, views
from flashbench.run.protocol import ArenaHandle


def test_layout_places_sets_and_slots_apart_and_aligned():
    inputs = {"q": torch.zeros(3, 5, dtype=torch.bfloat16), "index": torch.zeros(7, dtype=torch.int32)}
    layout = plan_layout(inputs, {"scale": 0.5}, {"out": ("float32", [3, 5])}, sets=2, slots=3)
    placed = [slot for group in layout.sets + layout.slots for slot in group.values()]
    assert len(placed) == 2 * 2 + 3
    assert all(slot.offset % 256 == 0 for slot in placed)
    spans = sorted((s.offset, s.offset + torch.empty(s.shape).numel() * 4) for s in placed)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no overlap
    assert layout.scalars == {"scale": 0.5}
    assert layout.nbytes >= spans[-1][1]


def test_a_worker_mapping_shares_the_judges_bytes(tmp_path):
    inputs = {"x": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    layout = plan_layout(inputs, {}, {"y": ("int64", [4])}, sets=1, slots=2)
    arena = Arena.create_file(layout.nbytes, tmp_path)
    try:
        views(arena.memory, layout.sets[0])["x"].copy_(inputs["x"])
        worker_memory = open_file_arena(arena.handle, layout.nbytes)
        assert torch.equal(views(worker_memory, layout.sets[0])["x"], inputs["x"])
        views(worker_memory, layout.slots[1])["y"].copy_(torch.tensor([1, 2, 3, 4]))
        assert views(arena.memory, layout.slots[1])["y"].tolist() == [1, 2, 3, 4]
        assert views(arena.memory, layout.slots[0])["y"].tolist() == [0, 0, 0, 0]
    finally:
        arena.close()
    assert not any(tmp_path.iterdir())  # the arena's file is gone with the job


EXPORTER = """
import sys, torch
from flashbench.run.arena import export_cuda
memory = torch.arange(1024, dtype=torch.int32, device="cuda").view(torch.uint8)
print(export_cuda(memory[256:]).model_dump_json(), flush=True)
sys.stdin.readline()  # the allocation lives until the importer is done
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_arena_exported_by_a_worker_is_mapped_by_the_judge():
    worker = subprocess.Popen([sys.executable, "-c", EXPORTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        handle = ArenaHandle.model_validate_json(worker.stdout.readline())
        arena = Arena.import_cuda(handle, 64, "cuda")
        assert arena.memory[:4].view(torch.int32).tolist() == [64]
        arena.close()
        with pytest.raises(ValueError, match="holds"):  # a handle that claims more than its allocation
            Arena.import_cuda(handle.model_copy(update={"offset": 1 << 30}), 64, "cuda")
    finally:
        worker.communicate("\n", timeout=60)


def test_each_arena_tensor_has_a_version_counter_of_its_own(tmp_path):
    """A redraw of one input in place must not look, to a solution caching on `_version`, like a
    change of another (as it would for views of one buffer)."""
    layout = plan_layout({"q": torch.zeros(4), "index": torch.zeros(4, dtype=torch.int32)}, {}, {}, sets=1, slots=0)
    arena = Arena.create_file(layout.nbytes, tmp_path)
    try:
        tensors = views(arena.memory, layout.sets[0])
        before = tensors["index"]._version
        tensors["q"].fill_(1.0)
        assert tensors["index"]._version == before
        assert tensors["index"].tolist() == [0, 0, 0, 0] and tensors["q"].tolist() == [1.0] * 4
    finally:
        arena.close()
