"""A GPU's measured peaks, from `flashbench calibrate`: the roofs for speed-of-light figures."""

from pydantic import BaseModel, Field

from .solution import HardwareName

# A peak no device reaches: a calibration of 0 or 1 byte/s put every honest result under the floor (flagged),
# one of infinity made every floor zero (nothing ever flagged). Measured peaks lie far inside these bounds.
MAX_PEAK = 1e18


class Calibration(BaseModel):
    hardware: HardwareName  # named in `report`'s Markdown, as a trace's is on boards
    # a large device-to-device copy, bytes read plus bytes written
    memory_bytes_per_s: float = Field(ge=1e6, le=MAX_PEAK, allow_inf_nan=False)
    matmul_flops_per_s: float = Field(ge=1e6, le=MAX_PEAK, allow_inf_nan=False)  # a large bf16 product, random data
    method: dict
    environment: dict
    timestamp: str

    def floor_ms(self, nbytes: float | None, flops: float | None) -> float | None:
        """The speed-of-light time: the larger of the memory and the arithmetic bound."""
        if nbytes is None and flops is None:
            return None
        return max((nbytes or 0) / self.memory_bytes_per_s, (flops or 0) / self.matmul_flops_per_s) * 1e3
