"""The judge-worker protocol: frames parse into typed messages or fail with a ProtocolError,
never into arbitrary objects; a CPU arena's descriptor crosses a socket of its own, one per job,
from the judge to the worker only."""

import array
import math
import fcntl
import os
import pickle
import socket
import struct
import threading
import time

import pytest
from pydantic import ValidationError

from flashbench.model import Workload
from flashbench.run.protocol import (ARENA_TAG, MAX_BATCH_CALLS, MAX_CALL_MS, MAX_FRAME_BYTES, ArenaHandle,
                                     ArenaLayout, Batch, BatchDone, Build, Call, CallTimes, Channel, ChannelClosed,
                                     ChannelTimeout, Failed, Open, Opened, ProtocolError, ReadTimes, Ready,
                                     fd_socket_pair, frame, parse_reply, parse_request, receive_fd, reply_limit,
                                     send_fd)


@pytest.fixture
def pipe_pair():
    to_worker_r, to_worker_w = os.pipe()
    to_judge_r, to_judge_w = os.pipe()
    judge, worker = Channel(to_judge_r, to_worker_w), Channel(to_worker_r, to_judge_w)
    yield judge, worker
    judge.close()
    worker.close()


def test_a_reply_round_trips(pipe_pair):
    judge, worker = pipe_pair
    worker.send(CallTimes(event_ms=[0.5, 0.25], links=[0, -(1 << 63)], flushed=[7, 8]))
    assert parse_reply(judge.receive_json(timeout=5)) == CallTimes(event_ms=[0.5, 0.25], links=[0, -(1 << 63)],
                                                                   flushed=[7, 8])
    worker.send(BatchDone())
    assert parse_reply(judge.receive_json(timeout=5)) == BatchDone()


def test_a_frame_made_ahead_arrives_as_its_message(pipe_pair):
    """The judge encodes a timed request before its clock starts; the worker cannot tell."""
    judge, worker = pipe_pair
    batch = Batch(calls=[Call(set=k % 2, slot=k, seed=k + 7) for k in range(300)], fresh_seed=3)
    judge.send(frame(batch), timeout=5)
    judge.send(batch, timeout=5)
    assert parse_request(worker.receive_json(timeout=5)) == batch == parse_request(worker.receive_json(timeout=5))


@pytest.mark.parametrize("timeout", [5, None])
def test_a_reply_counts_as_arrived_at_its_first_byte(pipe_pair, timeout):
    """The judge stops its clock and reads the outputs at a reply's first byte: a worker that writes one
    byte, makes its call, then writes the rest, has made the call after its reply."""
    judge, worker = pipe_pair
    whole = frame(BatchDone())
    os.write(worker.write_fd, whole[:1])
    arrived = []

    def on_arrival():
        arrived.append(True)
        os.write(worker.write_fd, whole[1:])  # the rest, only once the judge has taken the reply as arrived

    assert parse_reply(judge.receive_json(timeout, on_arrival)) == BatchDone() and arrived == [True]


def test_a_request_the_worker_never_reads_times_out_instead_of_blocking_the_judge(pipe_pair):
    """A worker that stops reading (and shrinks its pipe to a page) must not hold the judge in os.write: a
    request larger than the pipe, on the judge's non-blocking end, fails at its deadline."""
    judge, worker = pipe_pair
    fcntl.fcntl(worker.read_fd, 1031, 4096)  # F_SETPIPE_SZ, as a worker can
    os.set_blocking(judge.write_fd, False)
    large = Batch(calls=[Call(set=0, slot=k, seed=(1 << 60) + k) for k in range(MAX_BATCH_CALLS)])
    started = time.monotonic()
    with pytest.raises(ChannelTimeout):
        judge.send(large, timeout=0.3)
    assert time.monotonic() - started < 5


def test_a_pickle_is_not_a_reply(pipe_pair):
    judge, _ = pipe_pair

    class Exploit:
        def __reduce__(self):
            return (os.system, ("touch /nonexistent-flashbench-proof",))

    payload = pickle.dumps(Exploit())
    os.write(_worker_write_fd(pipe_pair), struct.pack("<I", len(payload)) + payload)
    with pytest.raises(ProtocolError, match="not a valid reply"):
        parse_reply(judge.receive_json(timeout=5))


@pytest.mark.parametrize("payload, where", [
    (b'{"kind": "failed", "status": "PASSED", "message": ""}', "status"),  # only the judge says PASSED
    (b'{"kind": "verdict", "status": "PASSED"}', "kind"),
    (b'{"kind": "call_times", "event_ms": [-1.0], "links": [0]}', "event_ms"),
    (b'{"kind": "call_times", "event_ms": [1e308, 1e308], "links": [0, 0]}', "event_ms"),  # finite; their sum is not
    (b'{"kind": "call_times", "event_ms": [1.0], "links": [0], "flushed": [0], "passed": true}', "passed"),
    (b'{"kind": "call_times", "event_ms": [1.0], "links": [0], "flushed": [0], "issue_ms": -1.0}', "issue_ms"),
    (b'{"kind": "call_times", "event_ms": [1.0], "links": [0], "flushed": [0], "issue_ms": 1e300}', "issue_ms"),
    (b'{"kind": "call_times", "event_ms": [1.0]}', "links"),
    (b'{"kind": "call_times", "event_ms": [1.0], "links": [9223372036854775808]}', "links"),  # past int64
    (b'{"kind": "call_times", "event_ms": [1.0], "links": [1.5]}', "links"),
    (b'{"kind": "call_times", "event_ms": [1.0], "links": ["7"]}', "links"),
    (b'{"kind": "call_times", "event_ms": [1.0], "links": [0]}', "flushed"),  # what each flush returned: required
    (b'{"kind": "call_times", "event_ms": [1.0], "links": [0], "flushed": [1.5]}', "flushed"),
    (b'{"kind": "batch_done", "event_ms": [1.0]}', "event_ms"),  # times come only when asked, off the clock
    (b'{"kind": "ready"', "message"),
])
def test_forged_or_malformed_replies_are_refused(payload, where):
    with pytest.raises(ProtocolError, match=where):
        parse_reply(payload)


def test_nan_times_are_refused():
    with pytest.raises(ProtocolError):
        parse_reply(b'{"kind": "call_times", "event_ms": [NaN], "links": [0]}')
    with pytest.raises(ProtocolError, match="issue_ms"):
        parse_reply(b'{"kind": "call_times", "event_ms": [1.0], "links": [0], "flushed": [0], "issue_ms": NaN}')


def test_infinities_in_a_job_reach_the_worker_as_they_are():
    """A workload's attn_sink of mean -inf (no sink) and a scalar of inf travelled as null: the worker refused
    its first request and exited, and every pair of the workload CRASHED."""
    workload = Workload(uuid="workload-inf", axes={}, inputs={"sink": {"type": "random", "mean": -math.inf},
                                                  "scale": {"type": "scalar", "value": math.inf}})
    layout = ArenaLayout(nbytes=0, sets=[], slots=[], scalars={"scale": math.inf, "nan": math.nan})
    job = parse_request(frame(Open(workload=workload, arena=None, layout=layout, flush="none", flush_bytes=1 << 20))[4:])
    assert job.workload.inputs["sink"].mean == -math.inf and job.workload.inputs["scale"].value == math.inf
    assert job.layout.scalars["scale"] == math.inf and math.isnan(job.layout.scalars["nan"])


def test_an_oversized_frame_is_refused_before_it_is_read(pipe_pair):
    judge, _ = pipe_pair
    os.write(_worker_write_fd(pipe_pair), struct.pack("<I", MAX_FRAME_BYTES + 1))
    with pytest.raises(ProtocolError, match="at most"):
        judge.receive_json(timeout=5)


def test_the_largest_honest_replies_fit_their_limits_and_a_padded_one_is_refused_unread(pipe_pair):
    """Every lane's judge parses its replies under one interpreter lock: a worker's BatchDone padded to 1 MiB
    of escaped duplicate keys (valid JSON) took 30-40 ms to parse, while another lane's judge waited to stop
    its clock. A reply may take what an honest one can hold, no more."""
    judge, worker = pipe_pair
    largest = CallTimes(event_ms=[1.2345678901234567e-05] * MAX_BATCH_CALLS, issue_ms=MAX_CALL_MS,
                        links=[-(1 << 63)] * MAX_BATCH_CALLS, flushed=[-(1 << 63)] * MAX_BATCH_CALLS)
    failed = Failed(status="RUNTIME_ERROR", message="\U0001f600" * 2000)  # four bytes a character
    for request, reply in ((ReadTimes(), largest), (Batch(calls=[]), failed), (Build(), Ready())):
        sending = threading.Thread(target=worker.send, args=(reply,))  # more than a pipe holds
        sending.start()
        assert parse_reply(judge.receive_json(timeout=5, max_bytes=reply_limit(request))) == reply
        sending.join()
    os.write(_worker_write_fd(pipe_pair), struct.pack("<I", MAX_FRAME_BYTES) + b'{"kind": "batch_done", ')  # padded
    with pytest.raises(ProtocolError, match="are accepted for this reply"):
        judge.receive_json(timeout=5, max_bytes=reply_limit(Batch(calls=[])))
    with pytest.raises(ValidationError):
        Batch(calls=[Call(set=0, slot=0)] * (MAX_BATCH_CALLS + 1))


def test_a_silent_worker_times_out(pipe_pair):
    judge, _ = pipe_pair
    with pytest.raises(ChannelTimeout):
        judge.receive_json(timeout=0.05)


def test_a_closed_pipe_is_reported(pipe_pair):
    judge, worker = pipe_pair
    worker.close()
    with pytest.raises(ChannelClosed):
        judge.receive_json(timeout=5)


def test_failure_statuses_are_what_a_worker_may_claim():
    assert parse_reply(b'{"kind": "failed", "status": "RUNTIME_ERROR", "message": "x"}') == Failed(
        status="RUNTIME_ERROR", message="x")
    assert parse_reply(b'{"kind": "ready"}') == Ready()


# Arenas.

def test_an_arena_handle_names_no_path():
    assert ArenaHandle(kind="memfd").model_dump() == {"kind": "memfd", "ipc_handle": "", "offset": 0,
                                                      "device_index": 0}
    with pytest.raises(ValidationError):
        ArenaHandle(kind="file")
    with pytest.raises(ValidationError):
        ArenaHandle(kind="memfd", path="/tmp/arena")


def test_a_worker_exports_only_a_cuda_arena():
    exported = parse_reply(b'{"kind": "opened", "arena": {"kind": "cuda_ipc", "ipc_handle": "00"}}')
    assert exported.arena.kind == "cuda_ipc"
    with pytest.raises(ProtocolError, match="arena"):
        parse_reply(b'{"kind": "opened", "arena": {"kind": "memfd"}}')
    with pytest.raises(ValidationError):
        Opened(arena=ArenaHandle(kind="memfd"))


@pytest.mark.parametrize("arena, refused", [(None, False), ({"kind": "memfd"}, False), ({"kind": "cuda_ipc"}, True)])
def test_the_judge_hands_over_a_memfd_arena_or_none(arena, refused):
    with pytest.raises(ValidationError) as invalid:  # the workload is not one either: only `arena` is looked at
        Open.model_validate({"workload": {}, "arena": arena, "layout": {"nbytes": 0, "sets": [], "slots": []},
                             "flush": "none"})
    assert any(error["loc"][0] == "arena" for error in invalid.value.errors()) == refused


@pytest.fixture
def fd_sockets():
    judge, worker = fd_socket_pair()
    yield judge, worker
    judge.close()
    worker.close()


def test_an_arena_descriptor_crosses_the_socket_close_on_exec(fd_sockets):
    judge, worker = fd_sockets
    memfd = os.memfd_create("test", os.MFD_CLOEXEC)
    try:
        send_fd(judge, memfd)
        received = receive_fd(worker)
        assert os.path.samestat(os.fstat(received), os.fstat(memfd)) and received != memfd
        assert fcntl.fcntl(received, fcntl.F_GETFD) & fcntl.FD_CLOEXEC  # no process the solution starts inherits it
        os.close(received)
    finally:
        os.close(memfd)


def open_descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("payload, count", [
    (None, 0),  # nothing was sent
    (ARENA_TAG, 0),
    (ARENA_TAG, 2),  # the worker would take one and leave the other
    (b"something else", 1),
    (ARENA_TAG + b"x", 1),
])
def test_a_message_that_is_not_one_arena_descriptor_is_refused_and_its_descriptors_closed(fd_sockets, payload, count):
    judge, worker = fd_sockets
    before = open_descriptors()
    if payload is not None:
        read_end, write_end = os.pipe()
        judge.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [read_end] * count))]
                      if count else [])
        os.close(read_end)
        os.close(write_end)
    with pytest.raises(ProtocolError):
        receive_fd(worker)
    assert open_descriptors() == before


def test_the_worker_cannot_send_on_the_descriptor_socket(fd_sockets):
    """Nothing a worker sends can queue up in the judge, which never reads that socket."""
    _, worker = fd_sockets
    with pytest.raises(BrokenPipeError):
        worker.send(b"x")
    with pytest.raises(BrokenPipeError):
        worker.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0]))])


def test_sending_never_blocks_the_judge(fd_sockets):
    judge, worker = fd_sockets
    with pytest.raises(ProtocolError, match="does not take the descriptors"):
        for _ in range(100_000):  # a worker that never takes its arenas
            send_fd(judge, 0)
    worker.close()
    with pytest.raises(ChannelClosed):  # a worker that is gone
        send_fd(judge, 0)


def _worker_write_fd(pipe_pair) -> int:
    return pipe_pair[1].write_fd
