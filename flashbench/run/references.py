"""Reference outputs, computed in the runner's process (the reference is trusted) and cached on disk.

The cache key covers the definition's content, the reference source, the workload, the seed
and the device type, so editing any of them computes afresh.
"""

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..model import Definition, Workload
from ..workloads import generate_inputs


def cache_key(definition: Definition, reference_source: str, workload: Workload, seed: int, device_type: str) -> str:
    payload = json.dumps(
        [definition.model_dump(mode="json"), reference_source, workload.model_dump(mode="json"), seed, device_type],
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def reference_outputs(definition: Definition, reference, reference_source: str, workload: Workload,
                      seed: int, device: str, base_dir: Path, cache_dir: Path) -> dict[str, torch.Tensor]:
    """CPU tensors of the reference's outputs for (workload, seed) on `device`."""
    device_type = torch.device(device).type
    path = Path(cache_dir) / "references" / f"{cache_key(definition, reference_source, workload, seed, device_type)}.safetensors"
    if path.is_file():
        return load_file(str(path))
    inputs = generate_inputs(definition, workload, seed, device, base_dir)
    with torch.no_grad():
        returned = reference(*[inputs[name] for name in definition.inputs])
    if not isinstance(returned, (tuple, list)):
        returned = (returned,)
    outputs = {name: t.detach().to("cpu").contiguous() for name, t in zip(definition.outputs, returned)}
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    save_file(outputs, str(temporary))
    temporary.replace(path)  # never a half-written cache file
    return outputs
