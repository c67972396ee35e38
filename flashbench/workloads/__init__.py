"""Turning a workload record into concrete inputs that satisfy the definition.

Index structure (from structured generators) is seeded by the workload's uuid alone, so a
workload always has the same lengths and pages; tensor contents (random inputs, and the data a
generator makes, e.g. an FP8 KV cache) are seeded by the input set's seed, so several seeds give
independent input sets of the same shape, and a run whose seeds are secret has secret data.

Every call then redraws the random inputs with a row per output row whole (whole_redrawn,
refill_whole) and a window of each data input in place (draw_windows/window_copies for random
inputs, draw_data_windows/data_window_copies for generated data), from seeds revealed only in the
batch that makes the call: no output can be precomputed, and no cache of earlier calls answers one.
unredrawn_data_inputs names what carries data yet never changes (outputs that could be memoized).
"""

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..binding import BindingError, bind_axes, output_shapes
from ..dtypes import torch_dtype
from ..errors import shortened
from ..model import Definition, Workload
from ..model.workload import RandomInput, SafetensorsInput, ScalarInput
from .generators import DATA_OUTPUTS, GENERATORS, INDEX_RULES, DataSource, GeneratedData, IndexRule, sample_lengths
from .tensors import (DEFAULT_RANDOM, JOB_MEMORY_SHARE, LARGEST_GPU_BYTES, captured_memory_budget, input_set_bytes,
                      job_bytes, job_memory_budget, outputs_bytes, random_tensor, refill_random, safetensors_tensor,
                      scalable, scalar_value, symmetric)

__all__ = ["GENERATORS", "GeneratedData", "derive_seed", "generate_inputs", "random_inputs", "whole_redrawn",
           "refill_whole", "draw_windows", "window_copies", "window_elements", "window_spans", "window_starts",
           "generated_data", "redrawn_data", "draw_data_windows", "data_window_copies", "data_window_spans",
           "unredrawn_data_inputs", "index_inputs", "sample_lengths", "structured_inputs", "check_workload",
           "workload_problem", "set_memory_problem", "scalable", "symmetric"]


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any parts (seed, uuid, input name...)."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def generate_inputs(
    definition: Definition, workload: Workload, seed: int, device: str = "cpu", base_dir: Path = Path("."),
) -> dict[str, Any]:
    """Every input of `workload` on `device`, checked against the definition's shapes and constraints.
    Timed calls redraw parts of the random inputs and generated data in place (draw_windows,
    window_copies; draw_data_windows, data_window_copies)."""
    inputs, axes = structured_inputs(workload, device, seed, definition.const_axes)
    both = sorted(set(inputs) & set(workload.inputs))
    if both:
        raise BindingError(f"inputs.{both[0]}: a generator already makes this input; give it in one place only")
    axes = {**definition.const_axes, **workload.axes, **axes}
    captured_budget = captured_memory_budget()
    for name, spec in definition.inputs.items():
        if name in inputs:
            continue
        descriptor = workload.inputs.get(name, DEFAULT_RANDOM)
        if isinstance(descriptor, ScalarInput):
            inputs[name] = scalar_value(descriptor, spec.dtype)
        elif isinstance(descriptor, SafetensorsInput):
            # Captured tensors may be index tensors the constraints read: on "meta" they stay on the CPU.
            try:
                inputs[name] = safetensors_tensor(descriptor, base_dir, spec.dtype,
                                                  "cpu" if device == "meta" else device, captured_budget)
            except ValueError as exc:
                raise BindingError(f"inputs.{name}: {exc}") from None
            captured_budget -= inputs[name].nbytes
        else:
            if spec.shape is None:
                raise BindingError(f"input {name} is a scalar; give it as {{type: scalar, value: ...}}")
            shape = _concrete_shape(name, spec.shape, axes)
            try:
                # A constant input (a model weight) is the same in every input set and every workload of the
                # definition that draws it alike: a solution may keep what it derives from it (InputSpec.constant),
                # as a serving system keeps what it derives from its weights, however it keys what it keeps.
                drawn_from = constant_seed(definition, name) if spec.constant else random_seed(seed, workload, name)
                inputs[name] = random_tensor(descriptor, shape, spec.dtype, drawn_from, device)
            except ValueError as exc:
                if name not in workload.inputs:  # drawn by default: often an input a generator ought to make
                    raise BindingError(f"inputs.{name}: not given, so drawn at random, and {exc}; or capture it, or "
                                       "add the generator that makes it (an FP8 cache, an index table) to `generate`"
                                       ) from None
                raise BindingError(f"inputs.{name}: {exc}") from None
    bound = bind_axes(definition, inputs)
    for axis, value in workload.axes.items():
        if bound.get(axis) != value:
            raise BindingError(f"axes.{axis} is {value} in the workload but the inputs give {bound.get(axis)}")
    check_captured_structure(definition, workload, inputs, bound)
    return inputs


def check_captured_structure(definition: Definition, workload: Workload, inputs: dict[str, Any],
                             axes: dict[str, int]) -> None:
    """Captured index inputs must be what the generator that makes such inputs makes: each rule of INDEX_RULES
    that reads them (_reads_captured) holds of them. The constraints let through what no generator makes
    (a -1 among the blocks a request reads, offsets that go down), on which the reference and every solution
    read garbage. A generator's own structure is valid as made (the tests hold it to these rules)."""
    for rule in INDEX_RULES:
        if _reads_captured(rule, definition, workload, inputs, axes):
            try:
                rule.check({name: inputs[name].cpu().numpy() for name in rule.inputs}, axes)
            except ValueError as exc:
                raise BindingError(str(exc)) from None


def _reads_captured(rule: IndexRule, definition: Definition, workload: Workload, inputs: dict[str, Any],
                    axes: dict[str, int]) -> bool:
    """Whether `rule` holds of these inputs: the definition's are integer tensors of the rule's ranks (other inputs
    under those names are no structure its generator makes), one at least captured, and all have data here (a
    random one is shapes only on "meta": the run checks it once drawn)."""
    if not set(rule.axes) <= set(axes) or not _rule_fits(rule, definition):
        return False
    return (any(isinstance(workload.inputs.get(name), SafetensorsInput) for name in rule.inputs)
            and not any(inputs[name].is_meta for name in rule.inputs))


def _rule_fits(rule: IndexRule, definition: Definition) -> bool:
    """Whether the definition has the rule's inputs as integer tensors of its ranks."""
    specs = [definition.inputs.get(name) for name in rule.inputs]
    return all(spec is not None and spec.shape is not None and spec.dtype.startswith("int") and len(spec.shape) == rank
               for spec, rank in zip(specs, rule.inputs.values()))


def index_inputs(definition: Definition) -> set[str]:
    """The integer inputs that are index structure: any wider than a byte (offsets, ids, lengths, tables), and
    bytes (bool masks too) that a constraint or a generator's rule (INDEX_RULES) reads. Other bytes carry data: a
    packed FP8 cache, which a solution could memoize its outputs on if it never changed."""
    read = {name for expression in definition.constraint_expressions for name in expression.names}
    read |= {name for rule in INDEX_RULES if _rule_fits(rule, definition) for name in rule.inputs}
    return {name for name, spec in definition.inputs.items() if (spec.dtype.startswith("int") or spec.dtype == "bool")
            and (torch_dtype(spec.dtype).itemsize > 1 or name in read)}


def check_workload(definition: Definition, workload: Workload, base_dir: Path) -> dict[str, Any]:
    """What `validate` and `import-fib` check of one workload without drawing data: its axes and inputs are
    the definition's, and its inputs are made on "meta" (shapes only; index tensors for real) and bound; those
    inputs."""
    for axis in workload.axes:
        if axis not in definition.var_axes:
            raise BindingError(f"axes.{axis}: not a var axis of {definition.name}")
    for name in workload.inputs:
        if name not in definition.inputs:
            raise BindingError(f"inputs.{name}: not an input of {definition.name}")
    try:
        return generate_inputs(definition, workload, seed=0, device="meta", base_dir=base_dir)
    except MemoryError as exc:  # index structure past this machine's memory (a page pool of 10^12)
        raise BindingError(f"its index structure does not fit in memory here: {shortened(str(exc))}") from None
    except RuntimeError as exc:  # torch's own refusal of the shapes (a size past int64 in all): the workload's
        raise BindingError(f"its inputs cannot be made: {shortened(str(exc).splitlines()[0])}") from None


def workload_problem(definition: Definition, workload: Workload, base_dir: Path, device: str | None = None
                     ) -> str | None:
    """Why `validate` refuses a workload, which `run` does not run either; None if nothing. `run` names its device,
    which must hold one input set (set_memory_problem); `validate` names none."""
    try:
        inputs = check_workload(definition, workload, base_dir)
        outputs = output_shapes(definition, bind_axes(definition, inputs))
    except ValueError as exc:  # BindingError, and what making an input raises
        return str(exc)
    fixed = unredrawn_data_inputs(definition, workload)
    if fixed:  # the same data on every call: a solution could memoize its outputs
        return f"inputs {', '.join(fixed)} carry data that no call redraws"
    return set_memory_problem(input_set_bytes(inputs),
                              outputs_bytes({name: (definition.outputs[name].dtype, shape)
                                             for name, shape in outputs.items()}), device)


def set_memory_problem(set_bytes: int, output_bytes: int, device: str | None) -> str | None:
    """Why one input set (`set_bytes` of inputs, `output_bytes` of outputs) cannot be held where its job runs, told
    from shapes before anything is drawn (a judge that drew it regardless was killed for memory, the run lost). On a
    GPU (any GPU, with no device named, as in `validate`): a job of one set past job_memory_budget. On a CPU, where
    the judge keeps every set: the set past captured_memory_budget, which counts the copies a run keeps."""
    if device is not None and torch.device(device).type != "cuda":
        needed, available = set_bytes + output_bytes, captured_memory_budget()
        what, where = "one input set", "of this machine's memory (a sixteenth) that one workload's inputs may take"
    else:
        needed = job_bytes(1, set_bytes, output_bytes)
        available = job_memory_budget(device) if device else int(JOB_MEMORY_SHARE * LARGEST_GPU_BYTES)
        what, where = "a job of one input set (the judge's copies too)", f"a job may take of {device or 'any GPU'}"
    if needed <= available:
        return None
    return (f"{what} needs {needed:,} bytes ({set_bytes:,} of inputs, {output_bytes:,} of outputs), more than "
            f"the {available:,} {where}")


def random_seed(seed: int, workload: Workload, name: str) -> int:
    return derive_seed(seed, workload.uuid, name)


def constant_seed(definition: Definition, name: str) -> int:
    """The seed of a constant input drawn at random: the definition's and the input's alone, neither the set's nor
    the workload's, so that every call of a run (and every workload of it, where drawn alike) sees one weight."""
    return derive_seed(definition.name, name, "constant")


def random_inputs(definition: Definition, workload: Workload) -> list[str]:
    """Inputs drawn from `random` descriptors (explicit or by default), not by a generator, that every call draws
    afresh: all but those the definition declares constant (a model weight stays what it was drawn as)."""
    generated = set(structured_inputs(workload, "meta")[0])
    return [
        name for name, spec in definition.inputs.items()
        if spec.shape is not None and name not in generated and not spec.constant
        and isinstance(workload.inputs.get(name, DEFAULT_RANDOM), RandomInput)
    ]


def whole_redrawn(definition: Definition, names: list[str]) -> list[str]:
    """The random inputs among `names` that every call draws whole, not by a window: those whose first axis
    is the first axis of an output (a row of queries for a row of outputs). A window of one changes a few
    output rows; a solution could keep the others from the call before and compute only the rows whose
    inputs changed, which it finds by comparing its inputs with a copy (one read: cheap next to a
    compute-bound prefill). A fresh draw of every row leaves no output as it was."""
    leading = {spec.shape[0] for spec in definition.outputs.values() if spec.shape}
    return [name for name in names if definition.inputs[name].shape and definition.inputs[name].shape[0] in leading]


# A call's fresh data: all of a random input up to this size, else a window this large at an offset
# drawn from the call's seed. A cache of earlier results misses part of every call's changes unless it
# reads the whole input again. The worker writes the windows, so it knows where they fall: a copy derived
# from an input (a KV cache in fewer bits) can be kept and refreshed where they land; the tolerances bound
# how lossy such a copy may be (docs/threat_model.md, class 4).
REDRAW_WINDOW_BYTES = 1 << 20


def refill_whole(workload: Workload, inputs: dict[str, Any], names: list[str], call_seed: int,
                 generators: dict) -> None:
    """A call's fresh draw of each of `names` (whole_redrawn), in place, from the call's seed. `generators`
    keeps one torch generator per device across calls."""
    for name in names:
        tensor = inputs[name]
        generator = generators.get(tensor.device)
        if generator is None:
            generator = generators[tensor.device] = torch.Generator(device=tensor.device)
        refill_random(tensor, workload.inputs.get(name, DEFAULT_RANDOM), derive_seed(call_seed, workload.uuid, name,
                                                                                    "whole"), generator)


def window_elements(tensor) -> int:
    return min(tensor.numel(), max(1, REDRAW_WINDOW_BYTES // tensor.element_size()))


def draw_windows(definition: Definition, workload: Workload, like: dict[str, Any], names: list[str], seed: int,
                 calls: int) -> dict[str, Any]:
    """Fresh data for `calls` windows of each named random input, one draw per input (a batch of
    calls costs a few launches, not a few per call)."""
    fresh = {}
    for name in names:
        count = calls * window_elements(like[name])
        descriptor = workload.inputs.get(name, DEFAULT_RANDOM)
        fresh[name] = random_tensor(descriptor, [count], definition.inputs[name].dtype,
                                    derive_seed(seed, workload.uuid, name, "windows"), str(like[name].device))
    return fresh


def window_spans(like: dict[str, Any], names: list[str]) -> dict[str, int]:
    """The last offset a window of each named random input can start at."""
    return {name: like[name].numel() - window_elements(like[name]) for name in names}


def window_starts(seed: int, call_seeds: list[int], spans: dict[str, int]) -> dict[str, list[int]]:
    """Where each call's window of each input starts (0 to its span), drawn for a whole batch at once from
    the batch's seed and its calls' seeds: the host's work left per call is the copies themselves, issued
    while the device still runs the calls before it."""
    rng = np.random.default_rng([seed, *call_seeds])
    return {name: rng.integers(0, span + 1, size=len(call_seeds)).tolist() for name, span in spans.items()}


def window_copies(inputs: dict[str, Any], fresh: dict[str, Any], k: int,
                  starts: dict[str, list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(target, source) for each input of `fresh`: where in the input window `k` of its data goes (at
    starts[name][k]). Copying every source into its target is the call's redraw."""
    copies = []
    for name, data in fresh.items():
        flat = inputs[name].view(-1)
        count = window_elements(flat)
        start = starts[name][k]
        copies.append((flat[start:start + count], data[k * count:(k + 1) * count]))
    return copies


def structured_inputs(workload: Workload, device: str, seed: int | None = None,
                      const_axes: dict[str, int] | None = None) -> tuple[dict[str, Any], dict[str, int]]:
    """The inputs made by the workload's structured generators, and the axis values they decide.
    Their structure is seeded by the workload alone; the data a generator makes, by `seed` too.
    A generator may not decide a const axis (`const_axes`, the definition's) otherwise: a table of 32-token
    blocks binds to a definition of 64-token pages, and every call then reads other keys than it laid out."""
    inputs: dict[str, Any] = {}
    axes: dict[str, int] = {}
    const_axes = const_axes or {}
    for i, spec in enumerate(workload.generate):
        rng = np.random.default_rng(derive_seed(workload.uuid, "generate", i))
        make = GENERATORS[spec.generator]
        try:
            if spec.generator in DATA_OUTPUTS:  # on "meta", shapes only: no data drawn
                data = None if device == "meta" else \
                    DataSource.seeded(derive_seed(seed, workload.uuid, "generate", i, "data"), device)
                tensors, generated_axes = make(spec, rng, data)
            else:
                tensors, generated_axes = make(spec, rng)
        except ValueError as exc:
            raise BindingError(f"generate[{i}] ({spec.generator}): {exc}") from None
        for axis, value in generated_axes.items():
            if const_axes.get(axis, value) != value:
                raise BindingError(f"generate[{i}] ({spec.generator}): makes {axis} {value}, "
                                   f"but the definition fixes it at {const_axes[axis]}")
        # On "meta" (shape-only checks) index tensors keep their data on the CPU for the constraints.
        target = "cpu" if device == "meta" else device
        inputs.update({k: v if v.is_meta else v.to(target) for k, v in tensors.items()})
        axes.update(generated_axes)
    return inputs, axes


def generated_data(workload: Workload) -> dict[str, GeneratedData]:
    """The generated inputs that carry data, by name, and how a call redraws each (GeneratedData)."""
    found: dict[str, GeneratedData] = {}
    for i, spec in enumerate(workload.generate):
        describe = DATA_OUTPUTS.get(spec.generator)
        if describe is not None:
            try:
                found.update(describe(spec, np.random.default_rng(derive_seed(workload.uuid, "generate", i))))
            except ValueError as exc:
                raise BindingError(f"generate[{i}] ({spec.generator}): {exc}") from None
    return found


def redrawn_data(definition: Definition, workload: Workload, like: dict[str, Any]) -> dict[str, GeneratedData]:
    """The generated data inputs a call redraws, placed on the device of `like`'s tensors."""
    return {name: data.on(like[name].device) for name, data in generated_data(workload).items()
            if data.fresh is not None and name in definition.inputs and isinstance(like.get(name), torch.Tensor)}


def unredrawn_data_inputs(definition: Definition, workload: Workload) -> list[str]:
    """Inputs that carry data yet no call redraws: generated data that cannot be redrawn, and captured
    (safetensors) tensors but index structure (index_inputs). They are the same on every call of a run
    (captured ones, of every run): a solution could memoize what it derives from them. Inputs the definition
    declares constant (model weights) may stay the same."""
    fixed = {name for name, data in generated_data(workload).items() if data.fresh is None}
    structure = index_inputs(definition)
    return [
        name for name, spec in definition.inputs.items() if not spec.constant and (
            name in fixed or (isinstance(workload.inputs.get(name), SafetensorsInput) and name not in structure))
    ]


def data_window(data: GeneratedData, tensor) -> tuple[int, int]:
    """(rows that carry data, rows a window covers): all of them up to REDRAW_WINDOW_BYTES."""
    rows = tensor.numel() // data.width if data.rows is None else data.rows.numel()
    per_row = data.width * tensor.element_size()
    return rows, min(rows, max(1, REDRAW_WINDOW_BYTES // per_row))


def draw_data_windows(workload: Workload, like: dict[str, Any], data: dict[str, GeneratedData], seed: int,
                      calls: int) -> dict[str, Any]:
    """Fresh rows for `calls` windows of each generated data input, one draw per input."""
    fresh = {}
    for name, spec in data.items():
        rows, count = data_window(spec, like[name])
        if rows == 0:
            continue
        device = like[name].device
        generator = torch.Generator(device=device).manual_seed(derive_seed(seed, workload.uuid, name, "windows"))
        fresh[name] = spec.fresh(calls * count, generator, device)
    return fresh


def data_window_spans(like: dict[str, Any], data: dict[str, GeneratedData]) -> dict[str, int]:
    """The last data row a window of each generated data input can start at (inputs with no data rows left out,
    as draw_data_windows leaves them)."""
    spans = {}
    for name, spec in data.items():
        rows, count = data_window(spec, like[name])
        if rows:
            spans[name] = rows - count
    return spans


def data_window_copies(inputs: dict[str, Any], data: dict[str, GeneratedData], fresh: dict[str, Any], k: int,
                       starts: dict[str, list[int]]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                                                            list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Window `k` of each generated data input's fresh rows, to go to its data rows from starts[name][k] on:
    (target, window) where every row carries data (a slice of the input), and (table, rows, window) where
    the data rows are scattered (an indexed copy into the input's rows)."""
    sliced, indexed = [], []
    for name, fresh_rows in fresh.items():
        spec = data[name]
        table = inputs[name].view(-1, spec.width)
        _, count = data_window(spec, inputs[name])
        start = starts[name][k]
        window = fresh_rows[k * count:(k + 1) * count]
        if spec.rows is None:
            sliced.append((table[start:start + count], window))
        else:
            indexed.append((table, spec.rows[start:start + count], window))
    return sliced, indexed


def _concrete_shape(name: str, shape: list[str], axes: dict[str, int]) -> list[int]:
    unbound = [a for a in shape if a not in axes]
    if unbound:
        raise BindingError(f"input {name} needs axis {unbound[0]}; give it under the workload's axes")
    return [axes[a] for a in shape]


