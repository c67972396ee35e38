"""Build check of the CUDA solutions, no GPU needed.

For every solution folder whose solution.yaml says `language: cuda`, each `.cu` source (those
named under `sources`, else every `.cu` in the folder) is compiled on its own with
`nvcc -c <compile_flags> -Xptxas -v` in the folder its worker builds in (with the files of its
shared folders beside its own), which must succeed, and ptxas's resource report must show
no register spills (0 bytes spill stores and loads) for any kernel. The report (registers,
shared memory, stack per kernel and target), and when `cuobjdump` is on PATH a count of tensor-core
and asynchronous-copy instructions in the SASS, is printed (`pytest -n 0 -s` shows it).

Skipped when `nvcc` is not on PATH. Each compile is cached under the system temp directory by a
hash of the staged folder's sources, the flags and the nvcc version, so repeated runs, and folders of
several definitions that share one kernel, reuse it.
`.cpp` bindings are not compiled here: they need torch's CUDA headers.
"""

import hashlib
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from solution_checks import resource_report

from flashbench import Repo
from flashbench.run.plan import solution_candidate

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(tempfile.gettempdir()) / "flashbench-nvcc-check"
SASS_OPS = ("HGMMA", "HMMA", "LDGSTS", "UTMALDG", "LDSM", "LDL", "STL")


def cuda_sources():
    """(id, folder, source, flags) for every .cu source of every CUDA solution, in the folder its worker
    builds in."""
    found = []
    repo = Repo(ROOT)
    for definition in repo.names():
        for loaded in repo.solution_folders(definition):
            solution = loaded.solution
            if solution.language != "cuda":
                continue
            folder = solution_candidate(loaded, CACHE).folder
            names = solution.sources or sorted(p.name for p in folder.iterdir() if p.suffix == ".cu")
            flags = [str(f) for f in solution.compile_flags]
            for name in names:
                if name.endswith(".cu"):
                    found.append((f"{definition}/{solution.name}/{name}", folder, folder / name, flags))
    return found


SOURCES = cuda_sources()


def nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout


def folder_digest(folder: Path) -> bytes:
    """The files a compile can read: not the manifest or notes, so that the folders of several definitions
    sharing one kernel compile it once."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                       and p.name != "solution.yaml" and p.suffix != ".md"):
        digest.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.digest()


def compile_source(nvcc: str, folder: Path, source: Path, flags: list[str]) -> dict:
    """Compile once per content; returns {returncode, log, object}."""
    command_tail = ["-c", *flags, "-Xptxas", "-v", source.name]
    key = hashlib.sha256(
        folder_digest(folder) + json.dumps([source.name, command_tail]).encode() + nvcc_version(nvcc).encode()
    ).hexdigest()[:24]
    CACHE.mkdir(parents=True, exist_ok=True)
    record_path = CACHE / f"{key}.json"
    obj = CACHE / f"{key}.o"
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        if record["returncode"] != 0 or obj.is_file():
            return record
    proc = subprocess.run([nvcc, "-o", str(obj), *command_tail], cwd=folder, capture_output=True, text=True,
                          timeout=600)
    record = {"returncode": proc.returncode, "log": proc.stdout + proc.stderr, "object": str(obj)}
    record_path.write_text(json.dumps(record))
    return record


def sass_counts(obj: str) -> dict[str, dict[str, int]] | None:
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump is None or not Path(obj).is_file():
        return None
    proc = subprocess.run([cuobjdump, "-sass", obj], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        return None
    counts, current = {}, None
    for line in proc.stdout.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            current = counts.setdefault(m.group(1), dict.fromkeys(SASS_OPS, 0))
            continue
        if current is not None:
            m = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
            if m and m.group(1) in current:
                current[m.group(1)] += 1
    return counts


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("source_id,folder,source,flags", SOURCES, ids=[s[0] for s in SOURCES])
def test_cuda_source_compiles_without_spills(source_id, folder, source, flags):
    record = compile_source(shutil.which("nvcc"), folder, source, flags)
    assert record["returncode"] == 0, f"nvcc failed on {source_id}:\n{record['log'][-6000:]}"
    report = resource_report(record["log"])
    assert report, f"no ptxas resource report for {source_id}:\n{record['log'][-3000:]}"
    print(f"\n{source_id} ({' '.join(flags)})")
    sass = sass_counts(record["object"]) or {}
    for k in report:
        line = (f"  {k['kernel']} [{k['target']}]: {k.get('registers')} registers, {k.get('static_smem')} bytes "
                f"static smem, {k.get('stack')} bytes stack, {k.get('spill_stores')} / {k.get('spill_loads')} "
                f"bytes spill stores / loads")
        ops = [f"{op} {n}" for op, n in sass.get(k["kernel"], {}).items() if n]
        if ops:
            line += "; SASS " + ", ".join(ops)
        print(line)
    spilled = [k for k in report if k.get("spill_stores", 0) or k.get("spill_loads", 0)]
    assert not spilled, f"register spills in {source_id}: {spilled}"
    missing = [k["kernel"] for k in report if "spill_stores" not in k]
    assert not missing, f"no spill figures for {missing} in {source_id}"


EXPECTED_FOLDERS = (
    "mla_paged_decode_h16_ckv512_kpe64_ps1/cuda_splitkv/",
    "flashmla_decode_causal_h128_ckv512_kpe64_ps64/cuda_splitkv/",
    "flashmla_decode_causal_h16_ckv512_kpe64_ps64/cuda_splitkv/",
    "flashmla_decode_causal_h128_ckv512_kpe64_ps64/cuda_wgmma/",
    "flashmla_decode_causal_h16_ckv512_kpe64_ps64/cuda_wgmma_balanced/",
    "flashmla_decode_causal_h128_ckv512_kpe64_ps64/cuda_wgmma_balanced/",
    "mla_paged_prefill_causal_h16_ckv512_kpe64_ps1/cuda_wgmma/",
    "flashmla_sparse_prefill_h128_ckv512_kpe64_topk2048/cuda_wgmma/",
    "flashmla_sparse_prefill_sink_topklen_h64_ckv512_kpe64_topk2048/cuda_wgmma/",
)


@pytest.mark.parametrize("prefix", EXPECTED_FOLDERS)
def test_cuda_solutions_found(prefix):
    """The glob must see each CUDA solution (guards against a silently empty parametrisation)."""
    assert any(s[0].startswith(prefix) for s in SOURCES)
