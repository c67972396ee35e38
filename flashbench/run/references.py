"""Reference outputs, computed in the runner's process (the reference is trusted) and cached on disk.

The cache key covers the definition's content, the reference source, the workload, the seed
and the device type, so editing any of them computes afresh.
"""

import hashlib
import json
import os
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..model import Definition, Workload
from ..workloads import generate_inputs


def cache_key(definition: Definition, reference_source: str, workload: Workload, seed: int, device_type: str,
              variant: int = 0) -> str:
    payload = json.dumps(
        [definition.model_dump(mode="json"), reference_source, workload.model_dump(mode="json"), seed, device_type, variant],
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def reference_outputs(definition: Definition, reference, reference_source: str, workload: Workload,
                      seed: int, device: str, base_dir: Path, cache_dir: Path | None, variant: int = 0,
                      verify: bool = False) -> dict[str, torch.Tensor]:
    """CPU tensors of the reference's outputs for (workload, seed, variant) on `device`, cached
    in `cache_dir` (None: not cached). With `verify`, a cached entry is recomputed and compared:
    an entry someone else wrote is caught, reported and replaced; an unreadable one is replaced."""
    if cache_dir is None:
        return _compute(definition, reference, workload, seed, device, base_dir, variant)
    key = cache_key(definition, reference_source, workload, seed, torch.device(device).type, variant)
    path = Path(cache_dir) / f"{key}.safetensors"
    cached = _load(path)
    if cached is not None and not verify:
        return cached
    outputs = _compute(definition, reference, workload, seed, device, base_dir, variant)
    if cached is not None and not _same(cached, outputs):
        warnings.warn(f"reference cache entry {path} did not match a fresh computation; replaced")
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    save_file(outputs, str(temporary))
    temporary.replace(path)  # never a half-written cache file
    return outputs


def _load(path: Path) -> dict[str, torch.Tensor] | None:
    try:
        return load_file(str(path)) if path.is_file() else None
    except Exception:  # a torn or foreign file is recomputed, not trusted
        return None


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _compute(definition, reference, workload, seed, device, base_dir, variant) -> dict[str, torch.Tensor]:
    inputs = generate_inputs(definition, workload, seed, device, base_dir, variant)
    with torch.no_grad():
        returned = reference(*[inputs[name] for name in definition.inputs])
    if not isinstance(returned, (tuple, list)):
        returned = (returned,)
    return {name: t.detach().to("cpu").contiguous() for name, t in zip(definition.outputs, returned)}
