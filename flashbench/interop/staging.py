"""All-or-nothing writes into a repository: files and folders are prepared in a staging folder on the
same file system, then moved into place by renames. If a move fails, the ones already made are undone
and what they replaced is put back, so the repository holds all of the change or none of it.

Nothing is placed through a link: each folder on a target's way is opened from the one above it without following
one (moved by path, a committed link `definitions/<op_type>` sent an import's files out of the repository), and a
link on any target's way refuses the commit before anything is moved."""

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..build import open_below
from ..errors import FlashbenchError


class Staging:
    def __init__(self, root: Path, parent: Path):
        """`root`: the repository; `parent`: a folder of it (relative, made if missing, reached without a link: a
        linked cache folder put the staged files outside the repository), where removed paths go too."""
        self.root = root
        with contextlib.ExitStack() as held:
            open_folders(root, parent, held, made=[])
        self.folder = Path(tempfile.mkdtemp(prefix="staging-", dir=root / parent))
        self.paths: list[str] = []  # repository-relative paths to move in, in order

    def path(self, relative: str | Path) -> Path:
        """Where to prepare `relative` (a file or a folder); call add() once it is ready."""
        return self.folder / "new" / relative

    def add(self, relative: str | Path) -> None:
        if str(relative) not in self.paths:
            self.paths.append(str(relative))

    def drop(self, relative: str | Path) -> None:
        """Forget a prepared path: it will not be moved in."""
        if str(relative) in self.paths:
            self.paths.remove(str(relative))
        target = self.path(relative)
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()

    def write_text(self, relative: str | Path, text: str) -> None:
        target = self.path(relative)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(text.encode())
        self.add(relative)

    def copy(self, source: Path, relative: str | Path) -> None:
        target = self.path(relative)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        self.add(relative)

    def check(self, relative: str | Path) -> None:
        """FlashbenchError if a folder on the way to `relative` is a link or no folder."""
        with contextlib.ExitStack() as held:
            open_folders(self.root, Path(relative).parent, held)

    def commit(self) -> None:
        moves: list[Move] = []
        with contextlib.ExitStack() as held:  # the folders' descriptors, open until the moves are done or undone
            try:
                for relative in self.paths:
                    self.check(relative)
                for relative in self.paths:
                    move = Move(Path(relative).name, self.path(relative))
                    moves.append(move)
                    move.folder = open_folders(self.root, Path(relative).parent, held, move.made)
                    backup = self.folder / "old" / relative
                    backup.parent.mkdir(parents=True, exist_ok=True)
                    with contextlib.suppress(FileNotFoundError):  # nothing there to put aside
                        os.replace(move.name, backup, src_dir_fd=move.folder)
                        move.backup = backup
                    os.replace(move.staged, move.name, dst_dir_fd=move.folder)
                    move.placed = True
            except BaseException:
                for move in reversed(moves):
                    with contextlib.suppress(OSError):  # put back all that can be, whatever one of them does
                        move.undo()
                raise
            finally:
                self.discard()

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def open_folders(root: Path, relative: Path, held: contextlib.ExitStack,
                 made: list[tuple[int, str]] | None = None) -> int | None:
    """A descriptor (closed by `held`) of the folder `relative` of `root`, each folder on the way opened from the one
    above it without following a link (build.open_below); a missing one is made where `made` is given (and listed
    there for an undo), else None. FlashbenchError for a link or a file on the way."""
    folder = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    held.callback(os.close, folder)
    try:
        return open_below(folder, relative.parts, held, made)
    except NotADirectoryError as exc:  # a link too: O_NOFOLLOW with O_DIRECTORY
        raise FlashbenchError("a link or a file where a folder should be; nothing is placed through it",
                              root / exc.filename) from None
    except OSError as exc:  # no access, a read-only file system, a folder made beside us meanwhile
        if made is None and isinstance(exc, FileNotFoundError):
            return None
        raise FlashbenchError(f"cannot open or make this folder: {exc.strerror}", root / exc.filename) from None


@dataclass
class Move:
    """One path moved into the repository (`name` in the folder open as `folder`), and what undoing it takes."""

    name: str
    staged: Path  # where it was prepared
    folder: int | None = None
    backup: Path | None = None  # where what it replaced was put aside
    made: list[tuple[int, str]] = field(default_factory=list)  # parent folders it created (outermost first)
    placed: bool = False

    def undo(self) -> None:
        if self.placed:
            os.replace(self.name, self.staged, src_dir_fd=self.folder)
        if self.backup is not None:
            os.replace(self.backup, self.name, dst_dir_fd=self.folder)
        for folder, name in reversed(self.made):
            try:
                os.rmdir(name, dir_fd=folder)
            except OSError:  # not empty: something else lives there now
                pass
