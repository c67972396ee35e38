"""The worker's side of a job (run/worker/handler.py) without a process: what it does after a call.
(tests/test_supervisor.py starts real workers; the CUDA-graph capture itself needs a GPU.)"""

import io
import sys

import torch

from flashbench.run.protocol import Batch, Call, frame
from flashbench.run.worker.handler import Job, Worker, failed


def job_with_slots(slots: int) -> Job:
    stand_in = object.__new__(Job)
    stand_in.slots = [{"output": torch.full((4,), float("nan")), "lse": torch.full((2,), float("nan"))}
                      for _ in range(slots)]
    return stand_in


def test_a_replays_outputs_are_copied_from_its_sets_capture_slot_into_its_own():
    job = job_with_slots(6)
    job.slots[1]["output"].fill_(7.0)  # where set 1's graph writes
    job.slots[1]["lse"].fill_(-1.0)
    job.copy_replayed(Call(set=1, slot=4, seed=5))
    assert torch.equal(job.slots[4]["output"], torch.full((4,), 7.0))
    assert torch.equal(job.slots[4]["lse"], torch.full((2,), -1.0))
    assert all(torch.isnan(job.slots[k]["output"]).all() for k in (0, 2, 3, 5))  # no other slot touched


def test_a_failure_message_from_any_exception_fits_its_frame():
    class Unprintable(Exception):
        def __str__(self):
            raise ValueError("no")

    for make, part in (("the solution called sys.exit({!r})".format, "y" * 3000), (str, "bad \udc80 name"),
                       (str, Unprintable()), (str, "\U0001F600" * 3000)):
        message = failed("RUNTIME_ERROR", make, part)
        assert len(message.message) <= 2000
        frame(message)  # encodes


def test_no_exception_from_solution_code_ends_the_worker(monkeypatch):
    """Worker.handle, with a log that refuses lone surrogates as the real one (UTF-8, strict) does: what the
    solution's exception holds, or raises while its message is made, is its RUNTIME_ERROR, never the worker's end."""
    class Name(type):
        @property
        def __name__(cls):
            raise ValueError("no name")

    class Nameless(Exception, metaclass=Name):
        pass

    class Exits(Exception):
        def __str__(self):
            raise SystemExit(3)

    class Interrupts(Exception):
        def __str__(self):
            raise KeyboardInterrupt

    class Hides(Exception):
        def __str__(self):
            raise Nameless()

    class NoCode(SystemExit):
        @property
        def code(self):
            raise ValueError("no code")

    class Own(BaseException):
        pass

    raised = [ValueError("bad \ud800 text"), Nameless("x"), Exits(), Interrupts(), Hides(), NoCode(),
              KeyboardInterrupt(), GeneratorExit(), Own("its own")]
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="utf-8"))
    worker = object.__new__(Worker)
    for exc in raised:
        class Raises:
            def batch(self, request, exc=exc):
                raise exc
        worker.job = Raises()
        reply = worker.handle(Batch.model_construct(calls=[]))
        assert reply.status == "RUNTIME_ERROR", exc
        frame(reply)


def test_a_cpu_worker_sets_the_allocator_before_any_solution_code(monkeypatch):
    """A red team's solution that only set glibc's mallopt at import (keep what is freed, map no chunk) ranked
    1.6-1.9x faster than the same code without: the harness's steps allocate every batch, and cold pages fell on the
    honest solution's figure. The worker sets them itself for every CPU solution, before its code is loaded."""
    from flashbench.run.worker import handler

    order = []

    class Libc:
        def mallopt(self, parameter, value):
            order.append(("mallopt", parameter, value))

    def load_entry_point(folder, solution, build_dir):
        order.append("load")

    monkeypatch.setattr(handler.ctypes, "CDLL", lambda name: Libc())
    monkeypatch.setattr(handler, "load_entry_point", load_entry_point)
    worker = object.__new__(Worker)
    for device in ("cpu", "cuda"):
        order.clear()
        worker.device = device
        worker.setup = type("Setup", (), {"solution": None, "folder": "f", "build_dir": "b", "device": device})()
        worker.build()
        settings = [(handler.M_TRIM_THRESHOLD, 1 << 30), (handler.M_TOP_PAD, 64 << 20),
                    (handler.M_MMAP_THRESHOLD, handler.MAPPED_FROM_BYTES)]
        assert order == ([("mallopt", *setting) for setting in settings] if device == "cpu" else []) + ["load"]
