"""Publishing a directory whole: written under a temporary name, then renamed into place, so that
a reader (a resume, a second rank, a user's from_pretrained) sees it complete or not at all. Every
writer of a directory others read goes through here: checkpoints, their universal conversion,
final/ and its exports, the builtin assets.

A temporary name is one of its own (staging: made by mkdtemp, which never takes an existing name), so
that nothing removes what it did not create: an export to DIR/model leaves a user's DIR/model.tmp alone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """A rename is durable once its directory is: after a power cut the new name is there or the old one."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, target: Path, *, first_wins: bool = False) -> bool:
    """Rename the finished directory `tmp` to `target`; True if `target` is now tmp's content.

    An existing target is replaced (moved aside, then removed once the new one is in place, so
    that some complete version is always there), unless first_wins: then another writer (a
    concurrent rank building the same cached asset) got there first, its copy is kept and tmp
    discarded."""
    tmp, target = Path(tmp), Path(target)
    if first_wins:
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return False
    elif target.exists():
        old = new_directory_beside(target, "previous")  # target moved into it: no existing name is taken
        os.rename(target, old / target.name)
        os.rename(tmp, target)
        shutil.rmtree(old)
    else:
        os.rename(tmp, target)
    fsync_dir(target.parent)
    return True


def why_not_creatable(path: Path) -> tuple[str, str] | None:
    """Why `path` cannot be created, and which choice of path fixes it ('another' or 'a writable'); None
    when it can: its nearest existing ancestor is a directory this user may write."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is a file", "another"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable (permissions or a read-only filesystem)", "a writable"
    return None


def new_directory_beside(target: Path, label: str) -> Path:
    """A new, empty directory beside `target`, `.NAME.<random>.LABEL`: mkdtemp creates it, so it is no
    directory that existed before; its mode is what the umask gives a directory (mkdtemp's own is 0700),
    as the directory it becomes is published for others to read."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=f".{label}", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o777 & ~umask)
    return path


@contextmanager
def staging(target: Path, label: str = "tmp"):
    """A directory of its own to write `target` into (new_directory_beside), for publish(tmp, target);
    removed on the way out whatever happens, unless published (renamed into place) by then."""
    tmp = new_directory_beside(target, label)
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

