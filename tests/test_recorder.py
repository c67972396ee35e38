"""The trace recorder: the only writer of traces; changes by anyone else are undone and reported."""

import os
import threading

import pytest

from flashbench.run.recorder import TRACE_FILE_CHANGED, UNTRUSTED_SUFFIX, TraceRecorder
from flashbench.traces import read_traces

from trace_factory import make_trace


def recorder_in(tmp_path, definition: str = "op") -> TraceRecorder:
    """An open recorder (its trace directory held to the end of the test)."""
    return TraceRecorder(tmp_path / "traces" / "cpu_x86_64" / f"{definition}.jsonl", tmp_path / "traces",
                         save=True).__enter__()


def test_records_append_in_order(tmp_path):
    recorder = recorder_in(tmp_path)
    for name in ("a", "b"):
        trace, tampered = recorder.record(make_trace(name, "w1"))
        assert not tampered and trace.status == "PASSED"
    assert [t.solution for t in read_traces(recorder.trace_file)] == ["a", "b"]


def test_a_trace_file_changed_by_someone_else_is_restored_and_the_trace_rejected(tmp_path):
    recorder = recorder_in(tmp_path)
    recorder.record(make_trace("honest", "w1"))
    with open(recorder.trace_file, "a") as handle:
        handle.write(make_trace("forged", "w1").model_dump_json() + "\n")
    trace, tampered = recorder.record(make_trace("next", "w1"))
    assert tampered and trace.status == "REJECTED" and trace.message == TRACE_FILE_CHANGED
    assert [t.solution for t in read_traces(recorder.trace_file)] == ["honest", "next"]
    # what was found is kept aside, not lost: records someone appended were dropped without a word before
    (aside,) = recorder.untrusted
    assert [t.solution for t in read_traces(aside)] == ["honest", "forged"]


def test_only_what_boards_read_is_watched(tmp_path):
    """A report or notes written beside the traces during a run (`report --out traces/<hw>/<def>.md`) were
    renamed to *.untrusted; boards read trace files and calibrations alone. A file that vanishes while the
    directory is looked at (an editor's swap file) ended the run."""
    recorder = recorder_in(tmp_path)
    notes = tmp_path / "traces" / "nvidia_h200" / "op.notes.md"
    notes.parent.mkdir(parents=True)
    notes.write_text("# notes\n")
    calibration = tmp_path / "traces" / "nvidia_h200" / "calibration.json"
    calibration.write_text("{}")
    recorder.record(make_trace("honest", "w1"))
    assert notes.exists() and not calibration.exists() and len(recorder.untrusted) == 1


def test_files_appearing_in_the_trace_directory_are_set_aside(tmp_path, capsys):
    recorder = recorder_in(tmp_path)
    forged = tmp_path / "traces" / "nvidia_h200" / "op.graph.jsonl"
    forged.parent.mkdir(parents=True)
    forged.write_text(make_trace("forged", "w1").model_dump_json() + "\n")
    recorder.record(make_trace("honest", "w1"))
    assert not forged.exists()
    assert [p.name.endswith(UNTRUSTED_SUFFIX) for p in recorder.untrusted] == [True]
    assert "without flashbench writing it" in capsys.readouterr().err


def test_files_there_before_the_run_are_left_alone(tmp_path):
    earlier = tmp_path / "traces" / "nvidia_h200" / "op.jsonl"
    earlier.parent.mkdir(parents=True)
    earlier.write_text("")
    recorder = recorder_in(tmp_path)
    recorder.record(make_trace("honest", "w1"))
    assert earlier.exists() and not recorder.untrusted


def test_a_file_whose_metadata_alone_changed_is_not_set_aside(tmp_path):
    """A red team's worker at level process (root mapped to root) set the mtime of every trace file it found
    (os.utime: Landlock has no right for metadata), and the recorder set another GPU's results aside."""
    other = tmp_path / "traces" / "nvidia_h200" / "op.jsonl"
    other.parent.mkdir(parents=True)
    other.write_text(make_trace("kept", "w1").model_dump_json() + "\n")
    recorder = recorder_in(tmp_path)
    os.utime(other, (1, 1))
    recorder.record(make_trace("honest", "w1"))
    assert other.exists() and recorder.untrusted == []
    other.write_text(make_trace("forged", "w1").model_dump_json() + "\n")  # content changed: set aside
    recorder.record(make_trace("next", "w1"))
    assert not other.exists() and len(recorder.untrusted) == 1


def second_run_waits(first: TraceRecorder, second: TraceRecorder, capsys) -> None:
    """`second` opened while `first` is open: it says it waits and records nothing until `first` ends; neither
    sets the other's records aside."""
    entered = threading.Event()

    def run_second():
        with second:
            entered.set()
            second.record(make_trace("b", "w1"))

    thread = threading.Thread(target=run_second)
    thread.start()
    while "waiting for another flashbench run" not in capsys.readouterr().err:
        assert thread.is_alive() and not entered.is_set()
        entered.wait(0.01)
    first.record(make_trace("a", "w1"))
    assert not entered.is_set()
    first.__exit__(None, None, None)
    thread.join()
    assert entered.is_set() and not first.untrusted and not second.untrusted
    assert [t.solution for t in read_traces(first.trace_file)] == ["a"]
    assert [t.solution for t in read_traces(second.trace_file)] == ["b"]


def test_a_second_run_into_the_same_trace_directory_waits_for_the_first(tmp_path, capsys):
    """Two runs of different definitions into one trace directory: each would take the other's records for
    forgeries and set them aside. The second waits for the first to end, then runs as usual."""
    second = TraceRecorder(tmp_path / "traces" / "cpu_x86_64" / "second.jsonl", tmp_path / "traces", save=True)
    second_run_waits(recorder_in(tmp_path, "first"), second, capsys)


@pytest.mark.parametrize("first, second", [("traces", "traces/imported/x"), ("traces/imported/x", "traces")])
def test_runs_into_a_trace_directory_and_one_inside_it_wait_for_each_other(tmp_path, capsys, first, second):
    """A run watches its trace directory's whole tree: the run into traces/ set aside the records of a run into a
    folder inside it. Whichever starts second waits; runs into sibling folders do not."""
    def recorder(folder):
        return TraceRecorder(tmp_path / folder / "cpu_x86_64" / "op.jsonl", tmp_path / folder, save=True)

    holder = recorder(first).__enter__()
    with recorder("elsewhere"):  # a sibling of both: no wait
        pass
    second_run_waits(holder, recorder(second), capsys)


def test_a_link_to_a_folder_is_watched_whatever_its_name(tmp_path):
    """Boards follow traces/<hardware> when it is a link: one planted during the run, leading to a folder of
    forged records, was left where it was once only trace files and calibrations were watched."""
    recorder = recorder_in(tmp_path)
    forged = tmp_path / "elsewhere"
    forged.mkdir()
    (forged / "op.jsonl").write_text(make_trace("forged", "w1").model_dump_json() + "\n")
    (tmp_path / "traces" / "nvidia_h100").symlink_to(forged)
    recorder.record(make_trace("honest", "w1"))
    assert not (tmp_path / "traces" / "nvidia_h100").exists() and len(recorder.untrusted) == 1


def test_restoring_the_trace_file_writes_through_no_planted_link(tmp_path):
    """The restore's temporary name was fixed (op.restore) and written through a link planted there."""
    recorder = recorder_in(tmp_path)
    recorder.record(make_trace("honest", "w1"))
    victim = tmp_path / "victim.txt"
    victim.write_text("mine\n")
    (recorder.trace_file.with_suffix(".restore")).symlink_to(victim)
    with open(recorder.trace_file, "a") as handle:
        handle.write(make_trace("forged", "w1").model_dump_json() + "\n")
    trace, tampered = recorder.record(make_trace("next", "w1"))
    assert tampered and victim.read_text() == "mine\n" and not recorder.trace_file.is_symlink()
    assert [t.solution for t in read_traces(recorder.trace_file)] == ["honest", "next"]
