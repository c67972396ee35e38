"""A job's inputs as the judge keeps them (flashbench/run/judge/inputs.py): the sets as drawn on the host,
what each holds now on the job's device, and fresh device copies of a drawn set for its reference."""

import torch

from flashbench import Repo
from flashbench.run.judge.inputs import JobInputs, sets_within

DEFINITION = "mla_paged_decode_h16_ckv512_kpe64_ps1"


def job_inputs(repo_root, seeds=(11, 12), budget_bytes=None) -> JobInputs:
    repo = Repo(repo_root)
    workload = next(w for w in repo.workload_set(DEFINITION).workloads if w.name == "smoke_mixed")
    return JobInputs(repo.definition(DEFINITION), workload, list(seeds), "cpu", repo.definition_path(DEFINITION).parent,
                     budget_bytes=budget_bytes)


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


def test_the_sets_a_budget_holds_count_each_twice_the_baselines_and_the_output_slots():
    set_bytes, output_bytes = 100, 10
    held = {count: (2 * count + 1) * set_bytes + (count + 3) * output_bytes for count in (1, 2, 3)}  # 340, 550, 760
    assert [sets_within(held[3], 3, set_bytes, output_bytes), sets_within(held[3] - 1, 3, set_bytes, output_bytes),
            sets_within(held[2] - 1, 3, set_bytes, output_bytes), sets_within(0, 3, set_bytes, output_bytes),
            sets_within(10 ** 9, 2, set_bytes, output_bytes)] == [3, 2, 1, 1, 2]


def test_a_budget_keeps_the_first_sets_it_holds_and_draws_no_other(repo_copy):
    whole = job_inputs(repo_copy, seeds=(11, 12, 13))
    set_bytes = sum(t.numel() * t.element_size() for t in whole.tensors.values())
    two = job_inputs(repo_copy, seeds=(11, 12, 13), budget_bytes=5 * set_bytes + 5 * whole.output_bytes)
    assert len(whole.sets) == 3 and len(two.sets) == len(two.current) == 2
    for kept, drawn in zip(two.sets, whole.sets):  # the first seeds' sets, as drawn without a budget
        assert all(torch.equal(tensor, drawn[name]) for name, tensor in tensors(kept).items())
    assert len(job_inputs(repo_copy, seeds=(11, 12, 13), budget_bytes=1).sets) == 1

