"""The judge-worker protocol: frames parse into typed messages or fail with a ProtocolError,
never into arbitrary objects."""

import os
import pickle
import struct

import pytest

from flashbench.run.protocol import (MAX_FRAME_BYTES, BatchDone, Channel, ChannelClosed, ChannelTimeout, Failed,
                                     ProtocolError, Ready, parse_reply)


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
    worker.send(BatchDone(event_ms=[0.5, 0.25]))
    assert parse_reply(judge.receive_json(timeout=5)) == BatchDone(event_ms=[0.5, 0.25])


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
    (b'{"kind": "batch_done", "event_ms": [-1.0]}', "event_ms"),
    (b'{"kind": "batch_done", "event_ms": [1.0], "passed": true}', "passed"),
    (b'{"kind": "ready"', "message"),
])
def test_forged_or_malformed_replies_are_refused(payload, where):
    with pytest.raises(ProtocolError, match=where):
        parse_reply(payload)


def test_nan_times_are_refused():
    with pytest.raises(ProtocolError):
        parse_reply(b'{"kind": "batch_done", "event_ms": [NaN]}')


def test_an_oversized_frame_is_refused_before_it_is_read(pipe_pair):
    judge, _ = pipe_pair
    os.write(_worker_write_fd(pipe_pair), struct.pack("<I", MAX_FRAME_BYTES + 1))
    with pytest.raises(ProtocolError, match="at most"):
        judge.receive_json(timeout=5)


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


def _worker_write_fd(pipe_pair) -> int:
    return pipe_pair[1].write_fd
