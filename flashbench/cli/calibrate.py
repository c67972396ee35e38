"""`flashbench calibrate`."""

from pathlib import Path

import click

from ..calibrate import calibrate as measure, save_calibration
from . import console, main, repo_from, resolve_device


@main.command()
@click.option("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when present, else cpu).")
@click.option("--trace-dir", type=click.Path(file_okay=False, path_type=Path), default=None, help="Default: traces/ in the repo.")
@click.pass_context
def calibrate(ctx, device, trace_dir):
    """Measure the device's copy bandwidth and bf16 matmul rate (the roofs for % of speed-of-light)."""
    repo = repo_from(ctx)
    calibration = measure(resolve_device(device), repo.root)
    path = save_calibration(calibration, trace_dir or repo.root / "traces")
    console.print(f"{calibration.hardware}: {calibration.memory_bytes_per_s / 1e12:.2f} TB/s copy, "
                  f"{calibration.matmul_flops_per_s / 1e12:.0f} TFLOP/s bf16 matmul -> {path}", highlight=False)

