"""flashbench/run/plan.py: staging a solution folder for its worker. A folder the judge will not read
(build.walk_folder) becomes a candidate that carries why, so the run goes on, and no staging folder is
left behind on any path. (Selecting workloads and solutions: tests/test_runner.py; staging with shared
folders: tests/test_registry.py.)"""

import os
import shutil
from pathlib import Path

import pytest

from flashbench import FlashbenchError, Repo
from flashbench.build import MAX_FILE_BYTES, FolderError, content_hash
from flashbench.registry import load_solution_folder
from flashbench.run import RunOptions, Runner, select_solutions
from flashbench.run.plan import _copy_into, install_solution, stage_solution

REPO = Path(__file__).resolve().parents[1]
DEFINITION = "mla_paged_decode_h16_ckv512_kpe64_ps1"
CORRECT = Path(__file__).parent / "fixtures" / "solutions" / DEFINITION / "correct_dps"


def solution_folder(path: Path, name: str) -> Path:
    """correct_dps as a folder of its own (its shared files copied in), named `name`."""
    path.mkdir(parents=True)
    for item in [*CORRECT.iterdir(), *(CORRECT.parent.parent / "_shared" / "decode_support").iterdir()]:
        shutil.copy(item, path / item.name)
    manifest = (path / "solution.yaml").read_text().replace("shared: [decode_support]\n", "")
    (path / "solution.yaml").write_text(manifest.replace("name: correct_dps", f"name: {name}"))
    return path


def sparse_file(path: Path) -> None:
    with open(path / "weights.bin", "wb") as file:
        file.truncate(2 * MAX_FILE_BYTES)  # no disk: copied, it would write all of it


def bad_name(path: Path) -> None:
    open(os.fsencode(path) + b"/\xff\xfe.py", "wb").close()


def fifo(path: Path) -> None:
    os.mkfifo(path / "pipe")


def hard_link(path: Path) -> None:
    os.link(path / "kernel.py", path.parent / f"{path.name}-kernel.py")


def deep(path: Path) -> None:
    """1,500 nested folders ended the run in a RecursionError while staging."""
    inner = path / "/".join(["d"] * 40)
    inner.mkdir(parents=True)
    (inner / "x.py").write_text("")


def long_path(path: Path) -> None:
    """A path that fits where the folder is but not under the cache (ENAMETOOLONG while staging)."""
    inner = path / "/".join([name * 250 for name in "abcde"])
    inner.mkdir(parents=True)
    (inner / "x.py").write_text("")


# What each unreadable folder gets, and the start of the reason it gets.
UNREADABLE = {"sparse": (sparse_file, "weights.bin is "), "bad_name": (bad_name, "'\\udcff\\udcfe.py': "),
              "fifo": (fifo, "pipe is not a regular file"), "hard_link": (hard_link, "kernel.py is a hard link"),
              "deep": (deep, "d/d/d/d/d/d/d/d/d/d/d/d/d/d/d/d/d/d/d/d/d/d/d/d/d/d/d/d/d/d/d/d/d: 33 names deep"),
              "long_path": (long_path, "aaaaaaaaaa")}


@pytest.mark.parametrize("kind", UNREADABLE)
def test_an_unreadable_folder_is_not_staged_and_leaves_nothing(tmp_path, kind):
    make, reason = UNREADABLE[kind]
    path = solution_folder(tmp_path / kind, kind)
    make(path)
    with pytest.raises(FolderError) as refused:
        stage_solution(load_solution_folder(path), tmp_path / "staged")
    assert refused.value.message.startswith(reason)
    assert list((tmp_path / "staged").iterdir()) == []  # no .staging-* folder left


def test_the_runner_gives_unreadable_folders_a_problem_and_stages_the_others(tmp_path):
    folders = []
    for kind, (make, _) in UNREADABLE.items():
        folders.append(solution_folder(tmp_path / kind, kind))
        make(folders[-1])
    (solution_folder(tmp_path / "loop", "loop") / "loop").symlink_to("loop")
    folders += [tmp_path / "loop", solution_folder(tmp_path / "fine", "fine")]
    repo = Repo(REPO)
    runner = Runner(repo, DEFINITION, RunOptions(device="cpu", cache_dir=tmp_path / "cache", trace_dir=tmp_path / "t"))
    reference, *chosen = runner.candidates([load_solution_folder(path) for path in folders])
    problems = {candidate.solution.name: candidate.problem for candidate in chosen}
    assert [name for name, problem in problems.items() if problem] == [*UNREADABLE, "loop"]
    assert all(problem.startswith(UNREADABLE[name][1]) for name, problem in problems.items() if name in UNREADABLE)
    assert problems["loop"].startswith("loop is a link")  # refused before anything of it is staged
    fine = chosen[-1]
    assert fine.folder.name == fine.hash == content_hash(fine.folder)
    assert [p.name for p in (tmp_path / "cache" / "solutions").iterdir()] == [fine.hash]
    again = runner.candidates([load_solution_folder(folders[0])])[1]
    assert again.hash == chosen[0].hash  # same folder, same problem: --resume keeps its trace


@pytest.mark.parametrize("found", ["link", "file"])
def test_staging_writes_through_no_link_and_over_no_file(tmp_path, found):
    """Staging copies several folders into one: what one of them left at a path (a link leading out, a file) must
    not take another's files out of the copy (the runner wrote a .pth into site-packages through such a link)."""
    victim = tmp_path / "site-packages"
    victim.mkdir()
    staging = tmp_path / "staging"
    staging.mkdir()
    if found == "link":
        (staging / "d").symlink_to(victim)
    else:
        (staging / "d").write_text("")
    source = tmp_path / "payload"
    (source / "d").mkdir(parents=True)
    (source / "d" / "zz.pth").write_text("import os\n")
    with pytest.raises(FolderError, match="^d/zz.pth: d is a file in another of its folders"):
        _copy_into(source, staging)
    assert list(victim.iterdir()) == []
    (staging / "d").unlink()
    (staging / "d").mkdir()
    (staging / "d" / "zz.pth").symlink_to(victim / "planted.pth")
    with pytest.raises(FolderError, match="^d/zz.pth is in two of its folders"):
        _copy_into(source, staging)
    assert list(victim.iterdir()) == []


def test_a_folder_swapped_for_a_link_out_while_it_is_staged_stages_nothing_of_what_it_leads_to(tmp_path, monkeypatch):
    """Red team: the folder's owner swapped its sub-folder a/ for a link to a root-only folder (renameat2
    RENAME_EXCHANGE, every 15 ms) while the root runner staged it. Listed and read by path after the walk's lstat
    of a/, the root-only file was staged as a/util.py in 2 of 30 stagings, and the worker quoted it in a trace.
    Here the swap comes once kernel.py is read: after a/ is lstat'ed, before it is listed."""
    path = solution_folder(tmp_path / "mine", "mine")
    (path / "a").mkdir()
    (path / "a" / "util.py").write_text("K = 1\n")
    outside = tmp_path / "root-only"
    outside.mkdir()
    (outside / "util.py").write_text("RUNNER-SECRET\n")
    (tmp_path / "link").symlink_to(outside)
    loaded = load_solution_folder(path)
    original = os.open

    def read_then_swap(name, *args, **kwargs):
        try:
            return original(name, *args, **kwargs)
        finally:
            if os.path.basename(name) == "kernel.py" and not (path / "a").is_symlink():
                (path / "a").rename(tmp_path / "a.honest")
                (tmp_path / "link").rename(path / "a")
    monkeypatch.setattr(os, "open", read_then_swap)
    refusal = None
    try:
        stage_solution(loaded, tmp_path / "staged")
    except FolderError as exc:
        refusal = exc.message
    staged = [found for found in (tmp_path / "staged").rglob("*") if found.is_file()]
    assert [found for found in staged if b"RUNNER-SECRET" in found.read_bytes()] == []
    assert refusal == f"{path / 'a'} cannot be listed: Not a directory"  # a link, opened with O_DIRECTORY|O_NOFOLLOW


def test_a_cache_that_cannot_be_written_ends_the_run_with_one_line(tmp_path):
    """A file where the cache folder should be (or a full disk) ended the run in a traceback."""
    (tmp_path / "cache").write_text("garbage")
    options = RunOptions(device="cpu", cache_dir=tmp_path / "cache", trace_dir=tmp_path / "t")
    runner = Runner(Repo(REPO), DEFINITION, options)
    with pytest.raises(FlashbenchError, match="cannot write the cache: Not a directory") as refused:
        runner.candidates([load_solution_folder(solution_folder(tmp_path / "mine", "mine"))])
    assert "\n" not in str(refused.value)


def test_install_copies_through_the_same_walk(tmp_path):
    path = solution_folder(tmp_path / "mine", "mine")
    (path / "NOTES.md").write_text("notes travel with it\n")
    (path / "alias.py").symlink_to("kernel.py")
    root = tmp_path / "repo"
    shutil.copytree(REPO / "definitions" / "mla_paged", root / "definitions" / "mla_paged")
    installed = install_solution(Repo(root), path)
    assert (installed / "NOTES.md").is_file() and not (installed / "alias.py").is_symlink()
    assert content_hash(installed) == content_hash(path)
    os.mkfifo(path / "pipe")
    with pytest.raises(FolderError):
        install_solution(Repo(root), path)


def test_install_leaves_a_folder_the_repository_holds_as_it_is_and_refuses_one_of_other_code(tmp_path):
    """The hash leaves notes out: a copy of another author's code with notes of its own replaced theirs, and
    added a docs/ folder of its own."""
    root = tmp_path / "repo"
    shutil.copytree(REPO / "definitions" / "mla_paged", root / "definitions" / "mla_paged")
    theirs = solution_folder(tmp_path / "theirs", "mine")
    (theirs / "NOTES.md").write_text("the author's notes\n")
    installed = install_solution(Repo(root), theirs)
    before = {path.relative_to(installed): path.read_bytes() for path in installed.rglob("*") if path.is_file()}
    copy = solution_folder(tmp_path / "copy", "mine")
    (copy / "NOTES.md").write_text("deprecated, gives wrong results: use evil_fast\n")
    (copy / "docs").mkdir()
    (copy / "docs" / "more.md").write_text("more\n")
    assert install_solution(Repo(root), copy, content_hash(copy)) == installed
    assert {path.relative_to(installed): path.read_bytes() for path in installed.rglob("*") if path.is_file()} == before
    (copy / "kernel.py").write_text((copy / "kernel.py").read_text() + "\n# other code\n")
    with pytest.raises(FlashbenchError, match="is taken by .* which holds other code; not submitted"):
        install_solution(Repo(root), copy, content_hash(copy))
    assert [p.name for p in installed.parent.iterdir()] == ["mine"]
    assert {path.relative_to(installed): path.read_bytes() for path in installed.rglob("*") if path.is_file()} == before


@pytest.mark.parametrize("name, target", [("NOTES.md", "/etc/passwd"), ("docs", "/")])
def test_install_refuses_a_link_leading_out_even_in_documentation(tmp_path, name, target):
    """Documentation is never staged for a run, so a link there leading out passed it, and the installed copy kept
    the link: solutions/ of the repository then held a link to a file or folder of the host's."""
    path = solution_folder(tmp_path / "mine", "mine")
    (path / name).symlink_to(target)
    root = tmp_path / "repo"
    shutil.copytree(REPO / "definitions" / "mla_paged", root / "definitions" / "mla_paged")
    with pytest.raises(FlashbenchError, match=f"{name} is a link to .*; not submitted"):
        install_solution(Repo(root), path, content_hash(path))
    assert not (root / "solutions").exists()


def test_install_refuses_a_folder_whose_files_changed_after_they_ran(tmp_path):
    """`submit` installs what ran: a worker (or anyone) that changed the folder after the run gets nothing in,
    and the solution already installed under that name stays as it was."""
    path = solution_folder(tmp_path / "mine", "mine")
    root = tmp_path / "repo"
    shutil.copytree(REPO / "definitions" / "mla_paged", root / "definitions" / "mla_paged")
    ran = content_hash(path)
    installed = install_solution(Repo(root), path, ran)
    assert content_hash(installed) == ran
    (path / "kernel.py").write_text((path / "kernel.py").read_text() + "\n# changed after the run\n")
    with pytest.raises(FlashbenchError, match="its files changed after they ran"):
        install_solution(Repo(root), path, ran)
    assert content_hash(installed) == ran and [p.name for p in installed.parent.iterdir()] == ["mine"]


def test_a_folder_run_from_elsewhere_may_not_take_the_name_of_one_in_the_repository(tmp_path):
    """Boards tell solutions apart by name: a folder passed by path that called itself torch_vectorized took
    that solution's row."""
    repo = Repo(REPO)
    impostor = tmp_path / "impostor"
    shutil.copytree(REPO / "solutions" / DEFINITION / "torch_vectorized", impostor)
    (copy,) = select_solutions(repo, DEFINITION, [str(impostor)])  # the same code: the same row, rightly
    assert copy.solution.name == "torch_vectorized"
    with (impostor / "kernel.py").open("a") as kernel:
        kernel.write("\n# another solution now\n")
    with pytest.raises(FlashbenchError) as refused:
        select_solutions(repo, DEFINITION, [str(impostor)])
    assert refused.value.field == "name" and "is taken by" in refused.value.message
    (own,) = select_solutions(repo, DEFINITION, [str(REPO / "solutions" / DEFINITION / "torch_vectorized")])
    assert own.solution.name == "torch_vectorized"  # the repository's own folder, by path, is itself


def test_two_folders_of_one_run_may_not_share_a_name_with_other_code(tmp_path):
    """Two folders from elsewhere, both called mine, would be one board row, the last run's: an impostor
    writing zeros took the row of the honest folder it named itself after. Refused with one line, in case
    too; the same code under one name is one solution, rightly."""
    repo = Repo(REPO)
    honest, twin = solution_folder(tmp_path / "honest", "mine"), solution_folder(tmp_path / "twin", "mine")
    assert [f.solution.name for f in select_solutions(repo, DEFINITION, [str(honest), str(twin)])] == ["mine"] * 2
    with (twin / "kernel.py").open("a") as kernel:
        kernel.write("\n# another solution now\n")
    with pytest.raises(FlashbenchError) as refused:
        select_solutions(repo, DEFINITION, [str(honest), str(twin)])
    assert refused.value.field == "name" and f"is taken by {honest}" in refused.value.message
    assert refused.value.file == str(twin / "solution.yaml") and "\n" not in str(refused.value)
    (twin / "solution.yaml").write_text((twin / "solution.yaml").read_text().replace("name: mine", "name: Mine"))
    with pytest.raises(FlashbenchError, match="'Mine' differs from 'mine' .* only in case"):
        select_solutions(repo, DEFINITION, [str(honest), str(twin)])


def test_a_folder_named_twice_runs_once():
    """`--solution X --solution X` (or a name and its folder's path) ran and recorded every pair twice."""
    repo = Repo(REPO)
    folder = repo.solution_folders(DEFINITION)[0]
    chosen = select_solutions(repo, DEFINITION, [folder.solution.name, str(folder.path), folder.solution.name])
    assert [f.path.resolve() for f in chosen] == [folder.path.resolve()]


def test_a_name_a_reader_takes_for_another_is_refused(tmp_path):
    """`triton_spIitkv` (a capital i for the l), `torch_vect0rized` or `torch-vectorized` beside the repository's
    `triton_splitkv` and `torch_vectorized` are two folders and two board rows that a reader takes for one; so are
    `mine` and `rnine` within one run. Names apart only in a lowercase i and l, or in `ci` and `d`, are not."""
    repo = Repo(REPO)
    for alike, taken in (("triton_spIitkv", "triton_splitkv"), ("torch_vect0rized", "torch_vectorized"),
                         ("torch-vectorized", "torch_vectorized"), ("torch__vectorized", "torch_vectorized")):
        folder = solution_folder(tmp_path / alike, alike)
        with pytest.raises(FlashbenchError, match=f"'{alike}' reads as '{taken}' ") as refused:
            select_solutions(repo, DEFINITION, [str(folder)])
        assert refused.value.field == "name" and "\n" not in str(refused.value)
    mine, rnine = solution_folder(tmp_path / "a" / "mine", "mine"), solution_folder(tmp_path / "b" / "rnine", "rnine")
    with pytest.raises(FlashbenchError, match="'rnine' reads as 'mine'"):
        select_solutions(repo, DEFINITION, [str(mine), str(rnine)])
    apart = [solution_folder(tmp_path / name, name) for name in ("fill", "fiil", "precise", "predse")]
    assert len(select_solutions(repo, DEFINITION, [str(folder) for folder in apart])) == 4


def test_a_name_differing_from_a_repository_solutions_only_in_case_is_refused(tmp_path):
    """On a case-insensitive file system Torch_vectorized and torch_vectorized are one folder: selecting a folder
    named so from elsewhere, or installing one (or a shared folder) beside the other, is refused with one line;
    nothing is copied."""
    repo = Repo(REPO)
    twin = tmp_path / "twin"
    shutil.copytree(REPO / "solutions" / DEFINITION / "torch_vectorized", twin)
    (twin / "solution.yaml").write_text((twin / "solution.yaml").read_text().replace("name: torch_vectorized",
                                                                                    "name: Torch_vectorized"))
    with pytest.raises(FlashbenchError) as refused:
        select_solutions(repo, DEFINITION, [str(twin)])
    assert refused.value.field == "name" and "\n" not in str(refused.value)
    assert refused.value.message.startswith("the name 'Torch_vectorized' differs from 'torch_vectorized' (")
    root = tmp_path / "repo"
    shutil.copytree(REPO / "definitions" / "mla_paged", root / "definitions" / "mla_paged")
    installed = install_solution(Repo(root), solution_folder(tmp_path / "mine", "mine"))
    with pytest.raises(FlashbenchError, match="'Mine' differs from 'mine' in .* only in case") as refused:
        install_solution(Repo(root), solution_folder(tmp_path / "Mine", "Mine"))
    assert refused.value.field == "name" and [p.name for p in installed.parent.iterdir()] == ["mine"]
    source = tmp_path / "source" / "solutions"  # correct_dps with its shared folder, decode_support
    shutil.copytree(CORRECT, source / DEFINITION / "correct_dps")
    shutil.copytree(CORRECT.parent.parent / "_shared", source / "_shared")
    shutil.copytree(source / "_shared" / "decode_support", root / "solutions" / "_shared" / "Decode_support")
    with pytest.raises(FlashbenchError, match="'decode_support' differs from 'Decode_support' in .* only in case"):
        install_solution(Repo(root), source / DEFINITION / "correct_dps")
    assert [p.name for p in (root / "solutions" / DEFINITION).iterdir()] == ["mine"]
    assert [p.name for p in (root / "solutions" / "_shared").iterdir()] == ["Decode_support"]

