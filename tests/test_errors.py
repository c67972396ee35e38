"""flashbench/errors.py: the error people act on, and the cut of what a message quotes."""

from flashbench.errors import FlashbenchError, shortened
from flashbench.run.protocol import Failed


def test_an_error_names_its_file_and_field():
    error = FlashbenchError("must be positive", "defs/x.yaml", "axes.batch")
    assert str(error) == "defs/x.yaml: axes.batch: must be positive"
    assert error.detail == "axes.batch: must be positive"
    assert str(FlashbenchError("no such definition")) == "no such definition"


def test_a_shortened_text_stays_within_its_limit():
    assert shortened("short") == "short"
    assert shortened("x" * 200) == "x" * 200
    cut = shortened("x" * 5000)
    assert len(cut) == 200 and cut.endswith("...")
    # A worker's failure message may hold 2000 characters: a longer exception, cut, must still fit the frame.
    assert len(Failed(status="RUNTIME_ERROR", message=shortened("y" * 5000, 2000)).message) == 2000

