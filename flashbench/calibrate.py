"""`flashbench calibrate`: measure a device's memory bandwidth and bf16 matmul rate once."""

import os
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from .environment import describe_environment, hardware_name
from .model import Calibration, load_model
from .traces import hardware_slug, refuse_linked_folder, sole_writer

CALIBRATION_FILE = "calibration.json"


def calibration_path(trace_dir: Path, hardware: str) -> Path:
    return Path(trace_dir) / hardware_slug(hardware) / CALIBRATION_FILE


def load_calibration(trace_dir: Path, hardware: str) -> Calibration | None:
    """The device's calibration, None where there is none; a FlashbenchError for one that is not a plain file in a
    folder that is no link (read_traces says why), or no calibration."""
    path = calibration_path(trace_dir, hardware)
    if not os.path.lexists(path):
        return None
    refuse_linked_folder(path)
    return load_model(Calibration, path)


def calibrate(device: str, root: Path, copy_bytes: int | None = None, matmul_size: int | None = None,
              repeats: int = 20) -> Calibration:
    on_gpu = torch.device(device).type == "cuda"
    copy_bytes = copy_bytes or (4 << 30 if on_gpu else 64 << 20)
    matmul_size = matmul_size or (8192 if on_gpu else 512)
    copy_ms = _copy_ms(copy_bytes, device, repeats)
    a = torch.randn(matmul_size, matmul_size, device=device, dtype=torch.bfloat16)
    b = torch.randn(matmul_size, matmul_size, device=device, dtype=torch.bfloat16)
    matmul_ms = _median_ms(lambda: a @ b, device, repeats)
    return Calibration(
        hardware=hardware_name(device),
        memory_bytes_per_s=2 * copy_bytes / (copy_ms / 1e3),
        matmul_flops_per_s=2 * matmul_size**3 / (matmul_ms / 1e3),
        method={"copy_bytes": copy_bytes, "copy_ms": copy_ms, "matmul_size": matmul_size, "matmul_ms": matmul_ms,
                "repeats": repeats, "statistic": "median", "data": "random"},
        environment=describe_environment(device, root),
        timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )


def save_calibration(calibration: Calibration, trace_dir: Path) -> Path:
    path = calibration_path(trace_dir, calibration.hardware)
    with sole_writer(trace_dir):  # a run there would set it aside as a forgery
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(calibration.model_dump_json(indent=2) + "\n")
    return path


def _copy_ms(nbytes: int, device: str, repeats: int) -> float:
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return _median_ms(lambda: target.copy_(source), device, repeats)


def _median_ms(operation, device: str, repeats: int) -> float:
    for _ in range(3):
        operation()
    samples = []
    for _ in range(repeats):
        if torch.device(device).type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            operation()
            end.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            operation()
            samples.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(samples)
