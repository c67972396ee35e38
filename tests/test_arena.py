"""The arena: what the judge writes there, a worker's mapping sees, and what the worker writes the
judge reads. On a CPU it is a memfd the judge seals before the worker gets it: no process can
shrink or grow it (a shrunk arena made the judge's next read of its mapping raise SIGBUS, ending
the runner), and a worker maps only a descriptor that is such a memfd, of the layout's size."""

import fcntl
import gc
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from flashbench import Repo
from flashbench.run import select_workloads
from flashbench.run.arena import ALIGNMENT, Arena, open_memfd_arena, plan_layout, views
from flashbench.run.protocol import ArenaHandle, Opened, fd_socket_pair, receive_fd, send_fd
from flashbench.run.session import Session, _Stop


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
    assert layout.flush is None


def test_layout_places_the_flush_bytes_after_the_rest_when_there_are_any():
    """The L2 flush's keyed passes read bytes the judge drew and writes into the arena (recipe.L2Flush)."""
    inputs = {"q": torch.zeros(3, 5, dtype=torch.bfloat16)}
    plain = plan_layout(inputs, {}, {"out": ("float32", [3, 5])}, sets=2, slots=3)
    buffer = torch.zeros(17, 64, dtype=torch.int8)
    layout = plan_layout(inputs, {}, {"out": ("float32", [3, 5])}, sets=2, slots=3, flush_buffer=buffer)
    assert (layout.sets, layout.slots) == (plain.sets, plain.slots)
    assert (layout.flush.dtype, layout.flush.shape, layout.flush.offset) == ("int8", [17, 64], plain.nbytes)
    assert layout.nbytes == plain.nbytes + 17 * 64 + (-17 * 64) % 256


def arena_descriptors() -> list[str]:
    """This process's open descriptors of arenas."""
    found = []
    for entry in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{entry}").startswith("/memfd:flashbench-arena"):
                found.append(entry)
        except OSError:
            pass
    return found


def test_a_worker_mapping_shares_the_judges_bytes():
    inputs = {"x": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    layout = plan_layout(inputs, {}, {"y": ("int64", [4])}, sets=1, slots=2)
    before = arena_descriptors()
    arena = Arena.create_memfd(layout.nbytes)
    judge_end, worker_end = fd_socket_pair()
    try:
        assert arena.handle == ArenaHandle(kind="memfd") and "path" not in arena.handle.model_dump()
        views(arena.memory, layout.sets[0])["x"].copy_(inputs["x"])
        send_fd(judge_end, arena.fd)  # as the supervisor does, just before the Open frame
        received = receive_fd(worker_end)
        worker_memory = open_memfd_arena(received, layout.nbytes)
        with pytest.raises(OSError):  # the descriptor received is closed once mapped
            os.fstat(received)
        assert torch.equal(views(worker_memory, layout.sets[0])["x"], inputs["x"])
        views(worker_memory, layout.slots[1])["y"].copy_(torch.tensor([1, 2, 3, 4]))
        assert views(arena.memory, layout.slots[1])["y"].tolist() == [1, 2, 3, 4]
        assert views(arena.memory, layout.slots[0])["y"].tolist() == [0, 0, 0, 0]
        # Shared with a child process (as pickling for torch.multiprocessing does), an input stays in the arena:
        # moved to fresh shared memory, the worker's every input and slot was cut off from the judge's bytes.
        shared = views(worker_memory, layout.sets[0])["x"].share_memory_()
        shared.add_(1)
        assert torch.equal(views(arena.memory, layout.sets[0])["x"], inputs["x"] + 1)
    finally:
        arena.close()
        arena.close()  # twice is safe: the descriptor is closed once
        judge_end.close()
        worker_end.close()
    del worker_memory, shared  # a mapping holds a descriptor of its own (torch's shared storage) until it goes
    gc.collect()
    assert arena_descriptors() == before  # none outlives the job's tensors, and no file ever existed


# An attacker holding a descriptor of the arena (its own, or one opened anew through /proc, which is a
# file description of its own), in a process of its own. Prints what each attempt gave.
ATTACKER = """
import ctypes, fcntl, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
inherited = int(sys.argv[1])
reopened = os.open(f"/proc/self/fd/{inherited}", os.O_RDWR)
size = os.fstat(inherited).st_size
found = {}

def attempt(name, action):
    try:
        result = action()
        found[name] = "refused" if result == -1 and ctypes.get_errno() else "done"
    except OSError as exc:
        found[name] = "refused"

for label, fd in (("inherited", inherited), ("reopened", reopened)):
    attempt(f"{label} shrink", lambda: os.ftruncate(fd, 0))
    attempt(f"{label} shrink by one page", lambda: os.ftruncate(fd, size - 4096))
    attempt(f"{label} grow", lambda: os.ftruncate(fd, 2 * size))
    attempt(f"{label} grow by fallocate", lambda: libc.fallocate(fd, 0, 0, 2 * size))
    attempt(f"{label} seal writes", lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE))
found["size"] = os.fstat(reopened).st_size
found["punch a hole"] = "refused" if libc.fallocate(reopened, 0x2 | 0x1, 0, size) else "done"  # PUNCH_HOLE|KEEP_SIZE
print(json.dumps(found))
"""


def test_a_sealed_arena_cannot_be_shrunk_or_grown_from_another_process():
    """Only holes can be punched, which the judge reads as zeros: harmless, and no fault."""
    arena = Arena.create_memfd(3 * 4096)
    try:
        nbytes = arena.memory.numel()
        assert fcntl.fcntl(arena.fd, fcntl.F_GET_SEALS) == fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        arena.memory.fill_(7)
        given = os.dup(arena.fd)  # not close-on-exec, unlike the arena's own
        try:
            attacker = subprocess.run([sys.executable, "-c", ATTACKER, str(given)], pass_fds=(given,),
                                      capture_output=True, text=True, timeout=60)
        finally:
            os.close(given)
        assert attacker.returncode == 0, attacker.stderr
        found = json.loads(attacker.stdout)
        assert found.pop("size") == nbytes
        assert found.pop("punch a hole") == "done"
        assert found and set(found.values()) == {"refused"}, found
        assert os.fstat(arena.fd).st_size == nbytes  # checked before the judge touches its mapping
        assert int(arena.memory.sum()) == 0  # the hole reads as zeros...
        arena.memory.fill_(1)  # ...and is filled again by the next write
        assert int(arena.memory.sum()) == nbytes
    finally:
        arena.close()


def sealed_memfd(size: int, seals: int) -> int:
    fd = os.memfd_create("test", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def unsealable_memfd(size: int) -> int:
    fd = os.memfd_create("test", 0)  # no MFD_ALLOW_SEALING: F_SEAL_SEAL from the start
    os.ftruncate(fd, size)
    return fd


def regular_file(tmp_path) -> int:
    fd = os.open(tmp_path / "arena", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 1 << 16)
    return fd


@pytest.mark.parametrize("make, words", [
    (lambda tmp_path: sealed_memfd(1 << 16, 0), "not sealed"),  # a memfd anyone may truncate
    (lambda tmp_path: unsealable_memfd(1 << 16), "not sealed"),  # one that cannot even be sealed
    (lambda tmp_path: sealed_memfd(1 << 16, fcntl.F_SEAL_SHRINK), "not sealed"),  # it may still grow: not asked for
    (lambda tmp_path: sealed_memfd(4096, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW), "holds 4096 bytes"),
    (regular_file, "not a memfd"),  # a file in a folder, as the arena once was
    (lambda tmp_path: os.pipe()[0], "not a memfd"),
])
def test_a_worker_refuses_a_descriptor_that_is_not_a_sealed_memfd_of_the_layouts_size(tmp_path, make, words):
    fd = make(tmp_path)
    with pytest.raises(ValueError, match=words):
        open_memfd_arena(fd, 1 << 15)
    with pytest.raises(OSError):  # closed all the same
        os.fstat(fd)


def test_a_worker_maps_at_least_one_alignment_unit():
    fd = sealed_memfd(ALIGNMENT - 1, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    with pytest.raises(ValueError, match="needs 256"):  # an empty layout still maps ALIGNMENT bytes
        open_memfd_arena(fd, 0)


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


@pytest.mark.parametrize("offset", [1, 2, 6, ALIGNMENT + 2, -ALIGNMENT])
def test_a_cuda_arena_whose_offset_is_not_aligned_is_refused_before_it_is_mapped(offset):
    """The offset in a worker's Opened is the worker's word. The judge builds every view at that offset
    (views() takes any address); one off ALIGNMENT leaves bfloat16 and float32 views at odd addresses, and
    the judge's first fill of them faults with a sticky CUDA "misaligned address" that ends the runner.
    An honest worker's offset comes from torch's allocator (512-byte blocks)."""
    handle = ArenaHandle(kind="cuda_ipc", ipc_handle="00" * 64, offset=offset)
    with pytest.raises(ValueError, match=f"multiple of {ALIGNMENT}"):
        Arena.import_cuda(handle, 64, "cuda")  # refused before any driver call: runs without a GPU


def test_the_judge_rejects_a_worker_whose_exported_arena_is_misaligned(repo_copy):
    """Through the session: REJECTED "the worker's arena cannot be used", never an error out of the judge."""
    [workload] = select_workloads(Repo(repo_copy), "mla_paged_decode_h16_ckv512_kpe64_ps1", ["smoke_mixed"], "cpu")
    session = object.__new__(Session)  # only what _open_arena reads
    session.device, session.flush = "cuda:0", SimpleNamespace(method="read", nbytes=1 << 20)
    opened = Opened(arena=ArenaHandle(kind="cuda_ipc", ipc_handle="00" * 64, offset=1))
    deadline = SimpleNamespace(ask=lambda worker, request, fd=None: opened)
    worker = SimpleNamespace(log_tail=lambda: "")
    layout = plan_layout({"q": torch.zeros(4)}, {}, {"o": ("float32", [4])}, sets=1, slots=1)
    with pytest.raises(_Stop) as stopped:
        session._open_arena(worker, workload, layout, deadline)
    outcome = stopped.value.outcome
    assert outcome.status == "REJECTED" and "arena cannot be used" in outcome.message and not outcome.worker_usable


def test_each_arena_tensor_has_a_version_counter_of_its_own():
    """A redraw of one input in place must not look, to a solution caching on `_version`, like a
    change of another (as it would for views of one buffer)."""
    layout = plan_layout({"q": torch.zeros(4), "index": torch.zeros(4, dtype=torch.int32)}, {}, {}, sets=1, slots=0)
    arena = Arena.create_memfd(layout.nbytes)
    try:
        tensors = views(arena.memory, layout.sets[0])
        before = tensors["index"]._version
        tensors["q"].fill_(1.0)
        assert tensors["index"]._version == before
        assert tensors["index"].tolist() == [0, 0, 0, 0] and tensors["q"].tolist() == [1.0] * 4
    finally:
        arena.close()
