"""A job's inputs as the judge keeps them (flashbench/run/judge/inputs.py): the sets as drawn on the host,
what each holds now on the job's device, and fresh device copies of a drawn set for its reference."""

import torch

from flashbench import Repo
from flashbench.run.judge.inputs import JobInputs

DEFINITION = "mla_paged_decode_h16_ckv512_kpe64_ps1"


def job_inputs(repo_root) -> JobInputs:
    repo = Repo(repo_root)
    workload = next(w for w in repo.workload_set(DEFINITION).workloads if w.name == "smoke_mixed")
    return JobInputs(repo.definition(DEFINITION), workload, [11, 12], "cpu", repo.definition_path(DEFINITION).parent)


def tensors(inputs: dict) -> dict:
    return {name: value for name, value in inputs.items() if isinstance(value, torch.Tensor)}


def test_the_drawn_sets_the_current_sets_and_a_drawn_copy_share_no_memory(repo_copy):
    inputs = job_inputs(repo_copy)
    assert len(inputs.sets) == len(inputs.current) == 2
    for drawn, current in zip(inputs.sets, inputs.current):
        assert all(t.device.type == "cpu" for t in tensors(drawn).values())  # the host, whatever the device
        for name, tensor in tensors(current).items():
            assert torch.equal(tensor, drawn[name]) and tensor.data_ptr() != drawn[name].data_ptr()
    copy = inputs.drawn(1)
    for name, tensor in tensors(copy).items():
        assert torch.equal(tensor, inputs.sets[1][name])
        assert tensor.data_ptr() not in (inputs.sets[1][name].data_ptr(), inputs.current[1][name].data_ptr())
    before = {name: tensor.clone() for name, tensor in tensors(inputs.sets[1]).items()}
    for tensor in tensors(copy).values():
        tensor.zero_()  # a reference that wrote its inputs would change neither the drawn nor the current set
    assert all(torch.equal(inputs.sets[1][name], tensor) for name, tensor in before.items())


def test_the_sets_differ_by_seed_and_keep_their_scalars(repo_copy):
    inputs = job_inputs(repo_copy)
    assert any(not torch.equal(inputs.sets[0][name], inputs.sets[1][name]) for name in inputs.random_names)
    assert inputs.scalars and all(inputs.sets[0][name] == value for name, value in inputs.scalars.items())
    assert set(inputs.tensors) == set(tensors(inputs.sets[0]))
