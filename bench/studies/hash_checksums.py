"""Why checkpoints carry xxh3-128 checksums: throughput of finetune.checkpointing.manifest.file_checksums against
sha256, blake2b, crc32 and plain reading, on 4 files of 512 MiB (read from the page cache after a
warm-up pass, so it measures the CPU cost the hash adds to reading).

    .venv/bin/python bench/studies/hash_checksums.py [DIR]
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: finetune and bench.* import from it

from finetune.checkpointing.manifest import file_checksums  # noqa: E402


class _Crc32:
    def __init__(self):
        self.value = 0

    def update(self, data):
        self.value = zlib.crc32(data, self.value)


class _Nothing:
    def update(self, data):
        pass


def _stream(path: Path, hasher) -> None:
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            hasher.update(view[:n])


def main(directory: Path) -> None:
    block = os.urandom(64 << 20)
    names = [f"shard_{i}" for i in range(4)]
    for name in names:
        with open(directory / name, "wb") as f:
            for _ in range(8):
                f.write(block)
    total = sum((directory / n).stat().st_size for n in names)
    cases = {
        "xxh3_128 (file_checksums)": lambda: file_checksums(directory, names),
        "sha256": lambda: [_stream(directory / n, hashlib.sha256()) for n in names],
        "blake2b": lambda: [_stream(directory / n, hashlib.blake2b()) for n in names],
        "crc32": lambda: [_stream(directory / n, _Crc32()) for n in names],
        "read only": lambda: [_stream(directory / n, _Nothing()) for n in names],
    }
    for label, run in cases.items():
        run()  # warm-up: the files are in the page cache from here on
        best = float("inf")
        for _ in range(2):
            t = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t)
        print(f"{label:27s} {total / 2**30:.1f} GiB in 4 files: {total / best / 1e9:.2f} GB/s")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(dir=sys.argv[1] if len(sys.argv) > 1 else None) as d:
        main(Path(d))
