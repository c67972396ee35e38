import json
import os

import pytest
from trace_factory import CALIBRATION

from flashbench.calibrate import calibrate, load_calibration, save_calibration
from flashbench.errors import FlashbenchError


def test_calibration_measures_and_round_trips(tmp_path):
    calibration = calibrate("cpu", tmp_path, copy_bytes=1 << 20, matmul_size=64, repeats=3)
    assert calibration.memory_bytes_per_s > 0 and calibration.matmul_flops_per_s > 0
    assert calibration.method["copy_bytes"] == 1 << 20
    path = save_calibration(calibration, tmp_path)
    assert path.parent.name == "cpu_" + calibration.hardware.split()[-1].lower()
    assert load_calibration(tmp_path, calibration.hardware) == calibration


def test_floor_is_the_larger_bound(tmp_path):
    calibration = calibrate("cpu", tmp_path, copy_bytes=1 << 16, matmul_size=32, repeats=1)
    calibration = calibration.model_copy(update={"memory_bytes_per_s": 1e9, "matmul_flops_per_s": 1e12})
    assert calibration.floor_ms(1e6, 1e6) == 1.0  # memory-bound: 1 MB at 1 GB/s
    assert calibration.floor_ms(1e3, 1e10) == 10.0  # compute-bound: 1e10 FLOPs at 1 TFLOP/s
    assert calibration.floor_ms(None, None) is None


@pytest.mark.parametrize("field, value", [("memory_bytes_per_s", 0), ("memory_bytes_per_s", 1),
                                          ("matmul_flops_per_s", float("inf")), ("memory_bytes_per_s", float("nan"))])
def test_a_calibration_no_device_could_measure_is_refused_naming_its_field(tmp_path, field, value):
    """1 byte/s flagged every honest result as faster than the floor; infinity made every floor zero."""
    folder = tmp_path / "gpu_x"
    folder.mkdir()
    data = {**CALIBRATION.model_dump(), field: value}
    (folder / "calibration.json").write_text(json.dumps(data))
    with pytest.raises(FlashbenchError, match=field):
        load_calibration(tmp_path, "GPU X")


def test_a_calibration_that_is_a_link_a_fifo_or_in_a_linked_folder_is_refused_at_once(tmp_path):
    """A link to /proc/kmsg as calibration.json blocked `run` (holding the trace directory's lock) and every board."""
    folder = tmp_path / "gpu_x"
    folder.mkdir()
    (folder / "calibration.json").symlink_to("/proc/self/pagemap")
    with pytest.raises(FlashbenchError, match="it is a link"):
        load_calibration(tmp_path, "GPU X")
    (folder / "calibration.json").unlink()
    os.mkfifo(folder / "calibration.json")
    with pytest.raises(FlashbenchError, match="it is not a plain file"):
        load_calibration(tmp_path, "GPU X")
    real = tmp_path / "elsewhere"
    real.mkdir()
    (real / "calibration.json").write_text(CALIBRATION.model_dump_json())
    (tmp_path / "gpu_y").symlink_to(real)
    with pytest.raises(FlashbenchError, match="its folder is a link"):
        load_calibration(tmp_path, "GPU Y")
    assert load_calibration(tmp_path, "GPU Z") is None
