"""All-or-nothing writes into a repository: files and folders are prepared in a staging folder on the
same file system, then moved into place by renames. If a move fails, the ones already made are undone
and what they replaced is put back, so the repository holds all of the change or none of it."""

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path


class Staging:
    def __init__(self, root: Path, parent: Path):
        """`root`: the repository; `parent`: a folder on its file system (removed paths go there too)."""
        self.root = root
        parent.mkdir(parents=True, exist_ok=True)
        self.folder = Path(tempfile.mkdtemp(prefix="staging-", dir=parent))
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

    def commit(self) -> None:
        moves: list[Move] = []
        try:
            for relative in self.paths:
                move = Move(self.root / relative)
                moves.append(move)
                if move.target.exists():
                    backup = self.folder / "old" / relative
                    backup.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(move.target, backup)
                    move.backup = backup
                move.made = make_parents(move.target.parent)
                os.replace(self.path(relative), move.target)
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


def make_parents(folder: Path) -> list[Path]:
    """mkdir -p, returning the folders it made (outermost first), so that an undo can remove them."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        path.mkdir()
    return list(reversed(missing))


@dataclass
class Move:
    """One path moved into the repository, and what undoing it takes."""

    target: Path
    backup: Path | None = None  # where what it replaced was put aside
    made: list[Path] = field(default_factory=list)  # parent folders it created
    placed: bool = False

    def undo(self) -> None:
        if self.placed:
            if self.target.is_dir() and not self.target.is_symlink():
                shutil.rmtree(self.target)
            else:
                self.target.unlink()
        if self.backup is not None:
            os.replace(self.backup, self.target)
        for folder in reversed(self.made):
            try:
                folder.rmdir()
            except OSError:  # not empty: something else lives there now
                pass
