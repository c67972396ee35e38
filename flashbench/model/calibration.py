"""A GPU's measured peaks, from `flashbench calibrate`: the roofs for speed-of-light figures."""

from pydantic import BaseModel


class Calibration(BaseModel):
    hardware: str
    memory_bytes_per_s: float  # a large device-to-device copy, bytes read plus bytes written
    matmul_flops_per_s: float  # a large bf16 matrix product on random data
    method: dict
    environment: dict
    timestamp: str

    def floor_ms(self, nbytes: float | None, flops: float | None) -> float | None:
        """The speed-of-light time: the larger of the memory and the arithmetic bound."""
        if nbytes is None and flops is None:
            return None
        return max((nbytes or 0) / self.memory_bytes_per_s, (flops or 0) / self.matmul_flops_per_s) * 1e3
