"""A job's shared memory, which both the judge and the worker map.

On a CPU the arena is a memfd the judge makes, sizes and seals before the worker can reach it,
and hands over as a descriptor (protocol.send_fd); on a GPU it is device memory the worker
allocates and exports by CUDA IPC, so the kernels being timed run on memory of their own process.
Either way the judge writes the inputs and poisons the output slots there, and reads the outputs
back itself: nothing the worker says about its outputs is believed.

The judge never maps memory whose size the worker can change. (The arena was once a file in the
worker's writable exchange directory: a solution that truncated it made the judge's next read of
its own mapping raise SIGBUS, which ended the whole runner.) The seals, F_SEAL_SHRINK | F_SEAL_GROW
| F_SEAL_SEAL, hold for every descriptor and process: ftruncate and fallocate past the end fail
with EPERM, and no seal can be added or removed. What the worker can still do to the memory:
- write it (it must: the outputs), so F_SEAL_WRITE is out: the judge checks what it reads anyway;
- punch holes (fallocate PUNCH_HOLE, madvise MADV_REMOVE: the seals allow them, only F_SEAL_WRITE
  refuses them). A hole reads as zeros in every mapping, the judge's included, and is filled
  again by the next write: zeros in the inputs are a change the judge rejects, zeros in an output
  are wrong; never a fault in the judge;
- mremap, munmap, mprotect or madvise its own mapping: those change its mapping only;
- at isolation level process, as a root that can, poison a page (MADV_HWPOISON) or write the
  judge's memory through /proc: that level is no security boundary (docs/threat_model.md).
"""

import ctypes
import fcntl
import mmap
import os
import stat

import torch

from ..dtypes import dtype_name, nbytes, torch_dtype
from .protocol import ArenaHandle, ArenaLayout, TensorSlot

ALIGNMENT = 256
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL  # what the judge seals an arena with
RESIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW  # what a worker requires of one


def plan_layout(inputs: dict[str, torch.Tensor], scalars: dict, outputs: dict[str, tuple[str, list[int]]],
                sets: int, slots: int, flush_buffer: torch.Tensor | None = None) -> ArenaLayout:
    """Room for `sets` copies of the tensor inputs and `slots` copies of the outputs, and for the bytes the
    L2 flush's keyed passes read (`flush_buffer`, the judge's: recipe.L2Flush) where there are any."""
    offset = 0

    def place(dtype: str, shape: list[int]) -> TensorSlot:
        nonlocal offset
        slot = TensorSlot(offset=offset, dtype=dtype, shape=shape)
        offset += -(-max(nbytes(dtype, shape), 1) // ALIGNMENT) * ALIGNMENT
        return slot

    input_slots = [{name: place(dtype_name(t.dtype), list(t.shape)) for name, t in inputs.items()} for _ in range(sets)]
    output_slots = [{name: place(dtype, shape) for name, (dtype, shape) in outputs.items()} for _ in range(slots)]
    flush = None if flush_buffer is None else place(dtype_name(flush_buffer.dtype), list(flush_buffer.shape))
    return ArenaLayout(nbytes=offset, sets=input_slots, slots=output_slots, scalars=scalars, flush=flush)


def views(memory: torch.Tensor, slots: dict[str, TensorSlot]) -> dict[str, torch.Tensor]:
    """Typed tensors over the arena's bytes. Each is a tensor of its own over the arena's storage,
    not a view of one buffer, so it has its own version counter like a separately allocated input
    (a solution may key a cache on `_version`; an in-place redraw of one input must not move the
    others')."""
    storage = memory.untyped_storage()
    base = memory.storage_offset() * memory.element_size()
    out = {}
    for name, slot in slots.items():
        dtype = torch_dtype(slot.dtype)
        itemsize = torch.empty((), dtype=dtype).element_size()
        out[name] = torch.empty(0, dtype=dtype, device=memory.device).set_(storage, (base + slot.offset) // itemsize,
                                                                            slot.shape)
    return out


class Arena:
    """The judge's side: the arena's bytes for as long as the job runs."""

    def __init__(self, memory: torch.Tensor, handle: ArenaHandle, release, fd: int | None = None):
        self.memory = memory
        self.handle = handle
        self.fd = fd  # what the worker is sent (a memfd arena), until close
        self._release = release

    @classmethod
    def create_memfd(cls, nbytes: int) -> "Arena":
        """A CPU job's arena: a memfd the judge sizes and seals before anyone else can reach it (it
        has no name in any folder; close-on-exec), then maps. Its descriptor goes to the worker."""
        nbytes = max(nbytes, ALIGNMENT)
        fd = os.memfd_create("flashbench-arena", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS or os.fstat(fd).st_size != nbytes:
                raise OSError("the arena's memfd did not take its seals")
            mapped = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        # The mapping (and the descriptor Python's mmap keeps of it) goes with the last view of it;
        # `fd` with close().
        return cls(torch.frombuffer(mapped, dtype=torch.uint8), ArenaHandle(kind="memfd"), lambda: os.close(fd), fd)

    @classmethod
    def import_cuda(cls, handle: ArenaHandle, nbytes: int, device: str) -> "Arena":
        """A GPU job's arena: device memory the worker allocated and exported. (Memory a process maps
        through CUDA IPC ran at about 70 GB/s on the H200, so the kernels being timed must run on
        memory of their own process; the judge's reads and writes of the arena are few.) The handle
        is untrusted: it must open, and the allocation must hold the whole layout."""
        if handle.kind != "cuda_ipc":
            raise ValueError(f"an arena of kind {handle.kind} cannot be exported by a worker")
        # Every view the judge makes lies at this offset: one off alignment puts its float tensors at odd
        # addresses, and the judge's first fill of them faults with a sticky CUDA error that ends the runner.
        if handle.offset < 0 or handle.offset % ALIGNMENT:
            raise ValueError(f"the exported arena starts at offset {handle.offset} of its allocation; it must be "
                             f"a non-negative multiple of {ALIGNMENT}")
        index = torch.device(device).index or 0
        _current_context(index)
        base = ctypes.c_uint64()
        ipc = _IpcHandle.from_buffer_copy(bytes.fromhex(handle.ipc_handle))
        _driver_call("cuIpcOpenMemHandle_v2", ctypes.byref(base), ipc, ctypes.c_uint(1))  # lazy peer access
        start, size = ctypes.c_uint64(), ctypes.c_size_t()
        _driver_call("cuMemGetAddressRange_v2", ctypes.byref(start), ctypes.byref(size), base)
        nbytes = max(nbytes, ALIGNMENT)
        if handle.offset < 0 or base.value + handle.offset + nbytes > start.value + size.value:
            _driver_call("cuIpcCloseMemHandle", base)
            raise ValueError(f"the exported arena holds {size.value} bytes; the job needs {nbytes} at offset {handle.offset}")

        def release():
            torch.cuda.synchronize(index)
            _current_context(index)
            _driver_call("cuIpcCloseMemHandle", base)

        return cls(_device_tensor(base.value + handle.offset, nbytes, index), handle, release)

    def close(self) -> None:
        """Safe to call twice (the descriptor is closed once)."""
        self.memory = None
        self.fd = None
        release, self._release = self._release, None
        if release is not None:
            release()


def open_memfd_arena(fd: int, nbytes: int) -> torch.Tensor:
    """The worker's mapping of a CPU job's arena, from the descriptor it was sent (and closes): a
    memfd sealed against shrinking and growing that holds the whole layout, or a ValueError. (The
    judge relies on its own seals, not on this: it is the worker's own check of what it maps.)"""
    nbytes = max(nbytes, ALIGNMENT)
    try:
        check_sealed_memfd(fd, nbytes)
        # Mapped as torch's own shared memory (the storage keeps a duplicate of the descriptor): pickling an
        # input for a child process (torch.multiprocessing's reductions, a spawn Process's arguments) or
        # share_memory_() then reuses this memfd instead of moving the whole arena's storage to fresh shared
        # memory, which would detach every input set and output slot of the worker from the judge's memfd.
        storage = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)
    finally:
        os.close(fd)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def check_sealed_memfd(fd: int, nbytes: int) -> None:
    """A ValueError unless `fd` is a memory file sealed against resizing, of at least `nbytes`."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise ValueError("the arena's descriptor is not a memfd")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # EINVAL: a file that cannot be sealed (not a memfd)
        raise ValueError("the arena's descriptor is not a memfd") from None
    if seals & RESIZE_SEALS != RESIZE_SEALS:
        raise ValueError("the arena's memfd is not sealed against shrinking and growing")
    if info.st_size < nbytes:
        raise ValueError(f"the arena's memfd holds {info.st_size} bytes; the layout needs {nbytes}")


def export_cuda(memory: torch.Tensor) -> ArenaHandle:
    """The worker's side on a GPU: an IPC handle of the allocation holding `memory`, and where in it
    `memory` starts."""
    index = memory.device.index or 0
    _current_context(index)
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _driver_call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(memory.data_ptr()))
    ipc = _IpcHandle()
    _driver_call("cuIpcGetMemHandle", ctypes.byref(ipc), base)
    return ArenaHandle(kind="cuda_ipc", ipc_handle=bytes(ipc).hex(), offset=memory.data_ptr() - base.value,
                       device_index=index)


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class _DeviceMemory:
    """Hands a raw device pointer to torch without copying (the CUDA array interface)."""

    def __init__(self, pointer: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (pointer, False), "version": 3}


def _device_tensor(pointer: int, nbytes: int, index: int) -> torch.Tensor:
    return torch.as_tensor(_DeviceMemory(pointer, nbytes), device=f"cuda:{index}")


_driver = None


def _driver_call(name: str, *args) -> None:
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
    result = getattr(_driver, name)(*args)
    if result != 0:
        raise RuntimeError(f"{name} failed with CUDA driver error {result}")


def _current_context(index: int) -> None:
    """The driver calls above act on this thread's current context: make it the device's primary one."""
    torch.cuda.set_device(index)
    torch.cuda.current_stream(index).synchronize()
