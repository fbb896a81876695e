"""The releases of the dependencies whose internals finetune rests on, as tested: the suite runs on the
pinned ones (scripts/constraints.txt), and its tests marked `internals` (the compiled decode loop's
StaticCache under autocast, the serialiser async save defers, ...) run again on the oldest ones
pyproject.toml allows (scripts/constraints-oldest.txt, scripts/test_oldest.sh). Outside that range a run
says so in one line at start-up: it may work, but nothing has shown it does."""

from __future__ import annotations

from importlib import metadata

# package -> (oldest, newest) tested release; tests/test_versions.py keeps these equal to pyproject.toml's
# lower bound, scripts/constraints-oldest.txt and scripts/constraints.txt
TESTED = {"transformers": ("5.17.0", "5.23.0")}


def untested_release(package: str, installed: str, tested: tuple[str, str]) -> str | None:
    """One line when `installed` lies outside the tested (oldest, newest) range of minor releases, else None."""
    from packaging.version import Version

    def minor(version: str) -> tuple[int, ...]:  # a patch release of a tested minor counts as tested
        return Version(version).release[:2]

    oldest, newest = tested
    if minor(oldest) <= minor(installed) <= minor(newest):
        return None
    side = "older than the oldest" if minor(installed) < minor(oldest) else "newer than the newest"
    return (f"note: {package} {installed} is {side} release finetune is tested with ({oldest} to {newest}); "
            f"it may work, but if it fails, pip install {package}=={newest} (the tested pin)")


def untested_releases() -> list[str]:
    """A line for each installed dependency outside its tested range (module docstring)."""
    notes = []
    for package, tested in TESTED.items():
        try:
            installed = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
        note = untested_release(package, installed, tested)
        if note:
            notes.append(note)
    return notes
