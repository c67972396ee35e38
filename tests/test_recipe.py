"""The steps of a batch: the L2 flush methods and the batch loop, run on the CPU with small buffers."""

import contextlib
import time

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from flashbench.run import recipe
from flashbench.run.protocol import Batch, Call
from flashbench.run.recipe import (FLUSH_METHODS, LINK_PRIME, CallClock, InputSets, L2Flush, LinkedRedraw, flush_label,
                                   link_keys, link_values, negated_columns, mixed_link, output_link, release_cached_memory, run_batch,
                                   window_shifts)
from flashbench.workloads import random_inputs


@pytest.mark.parametrize("method", list(FLUSH_METHODS))
def test_every_flush_method_runs_and_writes_only_its_own_buffers(method):
    flush = L2Flush(method, "cpu", nbytes=4096)
    flush()
    flush()
    assert method in flush_label(method) or method == "none"


def test_an_unknown_flush_is_refused():
    with pytest.raises(ValueError, match="no L2 flush method"):
        L2Flush("flood", "cpu")


class RecordingInputs:
    def __init__(self):
        self.drawn, self.redrawn, self.flipped = [], [], []

    def draw(self, seed, calls):
        self.drawn.append((seed, len(calls)))
        self.calls = calls

    def redraw(self, k, link=None):
        if self.calls[k].seed is not None:
            self.redrawn.append((self.calls[k].set, self.calls[k].seed, k, None if link is None else int(link)))

    def keys(self, k):
        return torch.tensor([k, 1, 2, 3])

    def flip(self, k, flushed):
        self.flipped.append((k, flushed))


def no_outputs(call):
    return [torch.zeros(1)]


def test_a_batch_draws_once_then_redraws_flushes_flips_and_times_each_call():
    steps, inputs = [], RecordingInputs()
    calls = [Call(set=0, slot=0, seed=11), Call(set=1, slot=1), Call(set=0, slot=2, seed=12)]
    clock = CallClock("cpu", len(calls))
    slots = [torch.full((2,), float(k + 1)) for k in range(3)]

    def flush(link, keys):
        steps.append("flush")
        return (0 if link is None else int(link)) * 10 + int(keys[0])

    links, flushed = run_batch(Batch(calls=calls, fresh_seed=5), inputs, flush,
                               lambda call: steps.append(f"call {call.slot}"),
                               lambda call: steps.append(f"store {call.slot}"), clock, lambda call: [slots[call.slot]])
    assert inputs.drawn == [(5, 3)]
    # The first call and a call without a seed are linked to nothing; the third to the second's outputs.
    link = output_link([slots[1]]).item()
    assert inputs.redrawn == [(0, 11, 0, None), (0, 12, 2, link)]
    assert link_values(links) == [0, 0, link]
    # Each flush is given the call's link and keys; its result sets the call's signs.
    assert flushed == [0, 1, link * 10 + 2] and inputs.flipped == list(enumerate(flushed))
    assert steps == ["flush", "call 0", "store 0", "flush", "call 1", "store 1", "flush", "call 2", "store 2"]
    assert len(clock.times_ms()) == 3 and all(t >= 0 for t in clock.times_ms())


def test_steps_keyed_by_given_links_still_compute_each_link_from_the_outputs():
    """The judge's run of the steps keys each flush by the worker's reported links and must cost what the
    worker's run does: it reads the outputs of every linked call as the worker does."""
    calls = [Call(set=0, slot=0, seed=11), Call(set=0, slot=1, seed=12), Call(set=0, slot=2, seed=13)]
    read = {False: [], True: []}
    keyed = {False: [], True: []}
    for given in (False, True):
        def flush(link, keys, given=given):
            keyed[given].append(None if link is None else int(link))
            return link

        def outputs(call, given=given):
            read[given].append(call.slot)
            return [torch.full((2,), float(call.slot + 1))]

        run_batch(Batch(calls=calls, fresh_seed=5), RecordingInputs(), flush, lambda call: None, lambda call: None,
                  CallClock("cpu", 3), outputs, [None, 101, 202] if given else None)
    assert read[True] == read[False] == [0, 1]
    assert keyed[True] == [None, 101, 202] and keyed[False][1:] != [101, 202]


def test_an_output_link_of_large_outputs_is_summed_in_pieces_and_exact(monkeypatch):
    monkeypatch.setattr(recipe, "LINK_PIECE_WORDS", 1 << 12)
    output = torch.randint(-(1 << 15), 1 << 15, (1 << 16,), dtype=torch.int16).view(torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
        link = output_link([output]).item()
    assert link == sum(output.view(torch.int16).tolist())
    # a sum into int64 copies its input first: a piece's copy, not the whole output's (512 KB here)
    assert max(event.cpu_memory_usage for event in profiled.events()) <= 8 * (1 << 12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.bool,
                                   torch.float8_e4m3fn])
def test_an_output_link_sums_the_raw_words_and_sees_any_change(dtype):
    output = torch.arange(12).reshape(3, 4).to(dtype)
    lse = torch.arange(3, dtype=torch.float32)
    link = output_link([output, lse]).item()
    words = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    assert link == (output.reshape(-1).view(words[output.element_size()]).long().sum()
                    + 3 * lse.view(torch.int32).long().sum()).item()
    changed = output.clone()
    changed[2, 3] = 0
    assert output_link([changed, lse]).item() != link
    assert output_link([lse, output]).item() != link or dtype == torch.float32  # each output weighted by its place


def test_a_linked_redraw_rotates_its_windows_alike_on_both_sides(decode_inputs):
    """The worker rotates by a link it holds as a tensor, the judge by the integer the worker reports: the
    same sets; another link gives other sets."""
    definition, workload, made = decode_inputs
    names = random_inputs(definition, workload)
    sides = [InputSets(definition, workload, [{k: v.clone() for k, v in made.items()}], names) for _ in range(3)]
    calls = [Call(set=0, slot=0, seed=455), Call(set=0, slot=1, seed=456)]
    for sets, link in zip(sides, [torch.tensor(-12345), -12345, 77]):
        sets.draw(seed=123, calls=calls)
        sets.redraw(1, link)
    worker, judge, other = (sides[i].sets[0] for i in range(3))
    assert all(torch.equal(worker[name], judge[name]) for name in names)
    assert any(not torch.equal(worker[name], other[name]) for name in names)


def test_a_batch_records_how_long_the_host_took_to_issue_it():
    clock = CallClock("cpu", 2)
    start = time.perf_counter()
    run_batch(Batch(calls=[Call(set=0, slot=0), Call(set=0, slot=1)]), RecordingInputs(), lambda link, keys: link,
              lambda call: time.sleep(0.01), lambda call: None, clock, no_outputs)
    took_ms = (time.perf_counter() - start) * 1e3
    assert 20.0 <= clock.issue_ms <= took_ms  # both calls' host time, and nothing after the batch


def test_a_clock_made_once_reports_only_the_last_batch_and_grows_when_it_must():
    clock = CallClock("cpu", 4)
    for calls in (3, 1, 6):  # made for 4 calls: a batch of 6 grows it
        run_batch(Batch(calls=[Call(set=0, slot=k) for k in range(calls)]), RecordingInputs(), lambda link, keys: link,
                  lambda call: None, lambda call: None, clock, no_outputs)
        assert len(clock.times_ms()) == calls


def test_a_redrawn_window_is_the_same_on_both_sides_and_changes_the_set(decode_inputs):
    """The worker and the judge's replay write the same data for the same seeds, and a call changes
    its set (however large the input, a window of it)."""
    definition, workload, made = decode_inputs
    names = random_inputs(definition, workload)
    worker = InputSets(definition, workload, [{k: v.clone() for k, v in made.items()}], names)
    judge = InputSets(definition, workload, [{k: v.clone() for k, v in made.items()}], names)
    calls = [Call(set=0, slot=0), Call(set=0, slot=1, seed=456)]
    for sets in (worker, judge):
        sets.draw(seed=123, calls=calls)
        sets.redraw(1)
    for name in names:
        assert torch.equal(worker.sets[0][name], judge.sets[0][name])
        assert not torch.equal(worker.sets[0][name], made[name])
    worker.draw(seed=124, calls=calls)
    worker.redraw(1)
    assert any(not torch.equal(worker.sets[0][n], judge.sets[0][n]) for n in names)


def test_each_window_is_rotated_by_31_bits_of_the_link_its_own_way():
    """Links that agree in their low bits (here: differ by a window's length, 2^19) rotate windows apart;
    two windows of one call are rotated by different amounts; the worker's tensor and the judge's integer
    give the same shifts, at the ends of the int64 range too."""
    link, seed = 123456789012345, 42

    def shifts(link, windows=4):
        return window_shifts(mixed_link(link, seed), windows, "cpu")
    assert shifts(torch.tensor(link)).tolist() == shifts(link).tolist()
    assert len(set(shifts(link).tolist())) == 4 and all(0 <= v < LINK_PRIME for v in shifts(link).tolist())
    assert (shifts(link + (1 << 19)) % (1 << 19) != shifts(link) % (1 << 19)).all()
    for extreme in ((1 << 63) - 1, -(1 << 63), -1, 0):
        assert shifts(extreme, 2).tolist() == shifts(torch.tensor(extreme), 2).tolist()


def test_the_link_is_mixed_so_that_a_nudged_sum_moves_the_rotation_unpredictably():
    """The link is a sum a worker can nudge by small steps. Before the mix, a step of 1 moved every
    rotation by the window's multiplier, so a worker could pick the sum that gives a rotation it chose;
    through the mix, steps of 1 move it by amounts with no pattern, and another seed gives other ones."""
    links = range(10**9, 10**9 + 2000)
    mixed = [mixed_link(link, seed=7) for link in links]
    steps = {(after - before) % LINK_PRIME for before, after in zip(mixed, mixed[1:])}
    assert len(steps) > 1900 and all(0 <= value < LINK_PRIME for value in mixed)
    assert sum(a == b for a, b in zip(mixed, (mixed_link(link, seed=8) for link in links))) < 5
    ints = [mixed_link(link, seed=7) for link in (-(1 << 63), -12345, (1 << 63) - 1)]
    assert ints == [mixed_link(torch.tensor(link), seed=7).item() for link in (-(1 << 63), -12345, (1 << 63) - 1)]


def test_inputs_with_a_row_per_output_row_are_drawn_whole_the_rest_by_a_window(decode_inputs, monkeypatch):
    """The queries (first axis: the outputs' batch) are drawn afresh whole by every call, alike on both
    sides; the caches change only in their window (here 64 bytes)."""
    import flashbench.workloads as workloads
    monkeypatch.setattr(workloads, "REDRAW_WINDOW_BYTES", 64)
    definition, workload, made = decode_inputs
    names = random_inputs(definition, workload)
    assert workloads.whole_redrawn(definition, names) == ["q_nope", "q_pe"]
    sides = [InputSets(definition, workload, [{k: v.clone() for k, v in made.items()}], names) for _ in range(2)]
    calls = [Call(set=0, slot=0, seed=455), Call(set=0, slot=1, seed=456)]
    for sets in sides:
        sets.draw(seed=123, calls=calls)
        sets.redraw(1, 99)
    worker, judge = (side.sets[0] for side in sides)
    assert all(torch.equal(worker[name], judge[name]) for name in names)
    for name in ("q_nope", "q_pe"):
        assert (worker[name] != made[name]).float().mean() > 0.99
    for name in ("ckv_cache", "kpe_cache"):
        changed = int((worker[name] != made[name]).sum())
        assert 0 < changed <= 64 // worker[name].element_size()
    sides[1].draw(seed=123, calls=[calls[0], Call(set=0, slot=1, seed=457)])
    sides[1].redraw(1, 99)
    assert not torch.equal(sides[1].sets[0]["q_nope"], worker["q_nope"])  # another call, other queries


def test_a_query_drawn_whole_has_its_columns_signed_by_what_the_flush_returned(decode_inputs, monkeypatch):
    """Drawn from the call's seed alone, a query larger than a window was known when the batch arrived: a
    worker could start each request's pages outside the windows before the previous call ended. The
    signs of its columns (all but its first axis) now come from the mix of the link: another link, the
    same values with other signs; worker (tensor) and judge (integer) alike."""
    import flashbench.workloads as workloads
    monkeypatch.setattr(workloads, "REDRAW_WINDOW_BYTES", 64)
    definition, workload, made = decode_inputs
    names = random_inputs(definition, workload)
    calls = [Call(set=0, slot=0, seed=455), Call(set=0, slot=1, seed=456)]
    queries = []
    for link in (99, torch.tensor(99), 100):
        sets = InputSets(definition, workload, [{k: v.clone() for k, v in made.items()}], names)
        sets.draw(seed=123, calls=calls)
        sets.redraw(1, 5)
        sets.flip(1, link)  # the signs come from what the flush returned
        queries.append(sets.sets[0]["q_nope"])
    first, same, other = queries
    assert torch.equal(first, same) and not torch.equal(first, other)
    columns = first[0].numel()  # the query as rows of its first axis
    flipped = (first != other).reshape(-1, columns).float().mean(0)  # per column: all its elements or none
    assert torch.equal(first.abs(), other.abs()) or (first.abs() != other.abs()).float().mean() < 0.01
    whole, partly = int((flipped > 0.9).sum()), int(((flipped > 0) & (flipped <= 0.9)).sum())
    assert 0.25 * columns < whole < 0.75 * columns and partly <= 32  # but those the 64-byte window touched
    negated = negated_columns(mixed_link(99, 456), columns, "cpu")
    assert torch.equal(negated_columns(mixed_link(torch.tensor(99), 456), columns, "cpu"), negated)
    assert set(negated.tolist()) == {0, 1}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_a_column_sign_is_a_flip_of_the_sign_bit_exact_in_every_float_type(dtype):
    """Multiplying by -1 has no FP8 kernel on a CPU; flipping the word's sign bit is exact everywhere."""
    query = torch.randn(6, 2, 5).to(dtype)
    flipped = query.clone()
    size = flipped.element_size()
    _, masks, _ = LinkedRedraw((), 10, (size,), torch.device("cpu"))(7, link_keys([8], "cpu")[0])
    InputSets._flip_columns(InputSets._column_tables([flipped]), masks)
    negated = negated_columns(mixed_link(7, 8), 10, "cpu").bool().reshape(2, 5)
    assert torch.equal(flipped.float()[:, negated], -query.float()[:, negated])
    assert torch.equal(flipped.float()[:, ~negated], query.float()[:, ~negated]) and negated.any() and (~negated).any()


def test_every_call_of_a_batch_sees_fresh_generated_data_on_both_sides():
    """The FP8 quantize definition's only input is generated: the worker's and the judge's batch
    (run_batch, one code path) give each call a cache of its own, the same on both sides."""
    from pathlib import Path

    from flashbench import Repo, generate_inputs
    repo = Repo(Path(__file__).resolve().parents[1])
    name = "flashmla_sparse_fp8_quantize_ckv512_kpe64_ps64"
    definition = repo.definition(name)
    workload = next(w for w in repo.workload_set(name).workloads if w.name == "smoke_one_block")
    made = generate_inputs(definition, workload, 7, "cpu", repo.definition_path(name).parent)
    seen = {}
    for side in ("worker", "judge"):
        sets = InputSets(definition, workload, [{"kv_cache": made["kv_cache"].clone()}], random_inputs(definition, workload))
        assert sets.random_names == [] and sets.redrawn_names == ["kv_cache"]
        calls = [Call(set=0, slot=k, seed=100 + k) for k in range(4)]
        inputs = []
        run_batch(Batch(calls=calls, fresh_seed=5), sets, lambda link, keys: link,
                  lambda call: inputs.append(sets.sets[0]["kv_cache"].clone()), lambda call: None, CallClock("cpu", 4),
                  lambda call: [sets.sets[0]["kv_cache"]])  # outputs that depend on the inputs, as a call's do
        seen[side] = inputs
    assert all(torch.equal(a, b) for a, b in zip(seen["worker"], seen["judge"]))
    every = [made["kv_cache"], *seen["worker"]]
    assert all(not torch.equal(a, b) for i, a in enumerate(every) for b in every[i + 1:])


@pytest.fixture
def decode_inputs():
    from pathlib import Path

    from flashbench import Repo, generate_inputs
    root = Path(__file__).resolve().parents[1]
    repo = Repo(root)
    name = "mla_paged_decode_h16_ckv512_kpe64_ps1"
    definition = repo.definition(name)
    workload = next(w for w in repo.workload_set(name).workloads if w.name == "smoke_mixed")
    made = generate_inputs(definition, workload, 7, "cpu", repo.definition_path(name).parent)
    return definition, workload, {k: v for k, v in made.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("device, released", [("cuda:0", True), ("cpu", False)])
def test_cached_device_memory_goes_back_before_a_worker_needs_it(monkeypatch, device, released):
    """The judge's allocator cache is memory a worker, a process of its own, cannot use."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    release_cached_memory(device)
    assert calls == (["empty_cache"] if released else [])


def test_a_keyed_flush_returns_the_same_number_on_both_sides_and_another_for_any_other_link_key_or_byte():
    """The worker's flush reads the bytes the judge drew (written into the arena) and agrees with the
    judge's, for the worker's tensor link and the judge's integer; another link or other keys give another
    number, and so does one changed byte of the buffer: its result needs every byte read. A flush made
    apart draws other bytes, from a seed no one is told."""
    judge = L2Flush("read", "cpu", nbytes=1 << 20)
    worker = L2Flush("read", "cpu", nbytes=1 << 20, read_buffer=judge.read_buffer.clone())
    keys = link_keys([3, 4], "cpu")
    assert int(L2Flush("read", "cpu", nbytes=1 << 20)(-12345, keys[0])) != int(judge(-12345, keys[0]))
    given = worker(torch.tensor(-12345), keys[0])
    assert given.dtype == torch.int64 and given.dim() == 0 and 0 <= int(given) < LINK_PRIME
    assert int(given) == int(judge(-12345, keys[0])) == int(worker(-12345, keys[0]))
    assert int(worker(None, keys[0])) == int(judge(0, keys[0]))  # the first call of a batch: no link
    others = {int(judge(-12344, keys[0])), int(judge(-12345, keys[1])), int(judge(-12345 + LINK_PRIME, keys[0]))}
    assert int(given) not in others
    judge._read[4321 % judge._read.shape[0], 4321] += 1
    assert int(judge(-12345, keys[0])) != int(given)


def test_a_keyed_pass_is_no_sum_of_the_buffers_columns():
    """A product's plain sum is the buffer's column sums times the key, known without reading the buffer:
    two buffers with the same column sums give other digests."""
    from flashbench.run.recipe import KEYED_WIDTH, keyed_pass
    first = torch.randint(-60, 60, (20, KEYED_WIDTH), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    second = first.flip(0)  # the same rows in another order: the same column sums
    keys, link = link_keys([9], "cpu")[0], torch.tensor(77)
    assert torch.equal(first.long().sum(0), second.long().sum(0))
    assert int(keyed_pass(first, link, keys, 0)) == int(keyed_pass(first.clone(), link, keys, 0))
    swapped = first.clone()
    swapped[0, :2] = first[0, :2].flip(0)  # two bytes of one row exchanged
    assert int(keyed_pass(swapped, link, keys, 0)) != int(keyed_pass(first, link, keys, 0))
    bumped = first.clone()
    bumped[0, 0] += 1
    bumped[1, 0] -= 1  # the same column sums again
    assert int(keyed_pass(bumped, link, keys, 0)) != int(keyed_pass(first, link, keys, 0))


@pytest.mark.parametrize("method", ["none", "write"])
def test_a_flush_that_reads_nothing_returns_the_link_as_given(method):
    flush = L2Flush(method, "cpu", nbytes=4096)
    assert flush(None, link_keys([1], "cpu")[0]) is None
    link = torch.tensor(5)
    assert flush(link, link_keys([1], "cpu")[0]) is link


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_flush_replays_its_graph_and_its_products_are_exact():
    """The first flush issues its launches and captures them, the others replay the graph, each with its
    own link and keys; every result is the one the same passes give on the CPU over a copy of the GPU's
    buffer (an int8 product is exact, in any order of summation), and the write pass zeroes its buffer."""
    flush = L2Flush("write+read", "cuda", nbytes=16 << 20)
    on_cpu = L2Flush("read", "cpu", nbytes=16 << 20, read_buffer=flush.read_buffer.cpu())
    keys = link_keys([11, 12, 13, 14], "cuda")
    for k, link in enumerate([0, 99, -(1 << 63), (1 << 63) - 1]):
        flush._written.fill_(7)
        given = flush(torch.tensor(link, device="cuda") if k % 2 else link, keys[k])
        torch.cuda.synchronize()
        assert int(flush._written.max()) == 0
        assert int(given) == int(on_cpu(link, keys[k].cpu()))
    assert flush._graph is not None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_a_linked_redraw_derives_the_rotations_and_signs_of_each_link_and_seed(device):
    """The same rotations and sign masks as window_shifts and negated_columns give from mixed_link (and a
    factor from the mix), for the
    worker's tensor link and the judge's integer, call after call (on a GPU the first call captures a
    graph and the later ones replay it: each replay must see its own link and keys)."""
    lengths, width = (5, 128, 3), 12
    derive = LinkedRedraw(lengths, width, (1, 2), torch.device(device))
    seeds = [3, 4, 5, 6]
    keys = link_keys(seeds, device)
    for k, (link, seed) in enumerate(zip([99, -(1 << 63), 123456789, (1 << 63) - 1], seeds)):
        given = torch.tensor(link, device=device) if k % 2 else link
        rotations, masks, factor = derive(given, keys[k])
        mixed = mixed_link(link, seed)
        shifts = window_shifts(mixed, len(lengths), "cpu").tolist()
        assert [recipe.rotated(torch.arange(n, device=device), rotation).tolist()
                for n, rotation in zip(lengths, rotations)] == [
            [(i + shift) % n for i in range(n)] for n, shift in zip(lengths, shifts)]
        negated = negated_columns(mixed, width, "cpu")
        assert masks[1].cpu().tolist() == (negated * 0x80).tolist()
        assert masks[2].cpu().tolist() == (negated * -(1 << 15)).tolist()
        assert factor.item() == (torch.tensor(mixed, dtype=torch.float32) * 2.0 ** -31 + 1).item()
        assert 1 <= factor.item() < 2
    assert (derive._graph is not None) == (device == "cuda")


def test_a_cpu_rotates_by_slicing_the_rows_an_index_of_positions_gives():
    """On a CPU a rotation is its shift, applied by slicing: an index of a 1 MiB window's positions, made and
    gathered by, cost the host more than the window's draw, and a red team's worker that sliced instead (the same
    bytes) ran its steps in 40% of the judge's run of them, which the judge subtracts: PASSED at its forged
    clock's 1 µs. The rows are those a GPU's index gives, empty and one-row windows included."""
    lengths = (5, 1 << 19, 1, 0)
    rotations, _, _ = LinkedRedraw(lengths, 0, (), torch.device("cpu"))(123456789, link_keys([3], "cpu")[0])
    assert all(isinstance(rotation, int) for rotation in rotations)
    shifts = window_shifts(mixed_link(123456789, 3), len(lengths), "cpu").tolist()
    for n, shift, rotation in zip(lengths, shifts, rotations):
        source = torch.arange(n) * 3
        expected = source.index_select(0, (torch.arange(n) + shift).remainder_(max(n, 1)))
        assert torch.equal(recipe.rotated(source, rotation), expected)
        target = torch.full_like(source, -1)
        for into, rows in recipe.rotated_copies(target, source, rotation):
            into.copy_(rows)
        assert torch.equal(target, expected)


@contextlib.contextmanager
def solution_defaults(dtype: torch.dtype, device: str):
    """torch's process-wide defaults as a solution may set them at import, in the worker that runs its batches."""
    kept = torch.get_default_dtype(), torch.get_default_device()
    torch.set_default_dtype(dtype)
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_dtype(kept[0])
        torch.set_default_device(kept[1])


@pytest.mark.parametrize("definition_name, workload_name", [
    ("mla_paged_decode_h16_ckv512_kpe64_ps1", "smoke_mixed"),
    ("mha_varlen_prefill_causal_h128_dqk128_dv128", "smoke_varlen"),
    ("flashmla_sparse_fp8_quantize_ckv512_kpe64_ps64", "smoke_one_block"),
])
@pytest.mark.parametrize("dtype, device", [(torch.float64, "cpu"), (torch.float32, "meta")])
def test_a_solutions_torch_defaults_change_nothing_the_worker_draws_flushes_or_links(definition_name, workload_name,
                                                                                     dtype, device):
    """A solution that did its arithmetic in float64 (torch.set_default_dtype at import) was REJECTED
    "modified its inputs": the worker's redraws, made in its process, drew float64 values where the judge's
    drew float32. Every step the worker runs for the judge names its dtype and device; under a default
    device of "meta", a step that did not would fail or differ here."""
    from pathlib import Path

    from flashbench import Repo, generate_inputs
    repo = Repo(Path(__file__).resolve().parents[1])
    definition = repo.definition(definition_name)
    workload = next(w for w in repo.workload_set(definition_name).workloads if w.name == workload_name)
    made = generate_inputs(definition, workload, 7, "cpu", repo.definition_path(definition_name).parent)
    made = {k: v for k, v in made.items() if isinstance(v, torch.Tensor)}
    buffer = L2Flush("read", "cpu", nbytes=1 << 16).read_buffer
    seen = {}
    for side, defaults in (("judge", contextlib.nullcontext()), ("worker", solution_defaults(dtype, device))):
        with defaults:
            sets = InputSets(definition, workload, [{k: v.clone() for k, v in made.items()}],
                             random_inputs(definition, workload))
            flush = L2Flush("read", "cpu", nbytes=1 << 16, read_buffer=buffer.clone())
            calls = [Call(set=0, slot=k, seed=100 + k) for k in range(3)]
            drawn = []
            slots = [[t.clone() for t in made.values()] for _ in calls]
            links, flushed = run_batch(Batch(calls=calls, fresh_seed=5), sets, flush,
                                       lambda call: drawn.append({k: v.clone() for k, v in sets.sets[0].items()}),
                                       lambda call: None, CallClock("cpu", len(calls)), lambda call: slots[call.slot])
            seen[side] = drawn, link_values(links), [int(f) for f in flushed]
    assert seen["worker"][1:] == seen["judge"][1:]
    for worker, judge in zip(seen["worker"][0], seen["judge"][0]):
        assert all(worker[k].dtype == judge[k].dtype and torch.equal(worker[k], judge[k]) for k in judge)
