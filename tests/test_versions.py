"""finetune/versions.py: the tested range of transformers agrees with pyproject.toml's lower bound, the pin
the suite runs on (scripts/constraints.txt) and the oldest release scripts/test_oldest.sh runs the tests
marked `internals` with (scripts/constraints-oldest.txt); a release outside it gets one line at start-up."""

from __future__ import annotations

import re
from pathlib import Path

from finetune.versions import TESTED, untested_release

REPO = Path(__file__).resolve().parents[1]


def pins(path: Path) -> dict:
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", path.read_text(), flags=re.M))


def test_the_tested_range_is_pyprojects_lower_bound_and_the_pin():
    oldest, newest = TESTED["transformers"]
    assert f'"transformers>={oldest.rsplit(".0", 1)[0]},' in (REPO / "pyproject.toml").read_text()
    assert pins(REPO / "scripts" / "constraints.txt")["transformers"] == newest
    assert pins(REPO / "scripts" / "constraints-oldest.txt")["transformers"] == oldest


def test_a_release_outside_the_tested_range_gets_one_line():
    tested = ("5.17.0", "5.23.0")
    for inside in ("5.17.0", "5.20.1", "5.23.0", "5.23.2"):
        assert untested_release("transformers", inside, tested) is None, inside
    newer = untested_release("transformers", "5.24.0", tested)
    assert newer.startswith("note: transformers 5.24.0 is newer than the newest release") and "\n" not in newer
    assert "pip install transformers==5.23.0" in newer
    assert "older than the oldest" in untested_release("transformers", "5.16.2", tested)
    assert "newer" in untested_release("transformers", "5.24.0.dev0", tested)


def test_the_run_says_it_at_start_up(tmp_path):
    """The note is printed by the training command itself (a dry run here), before anything is loaded."""
    import subprocess
    import sys

    code = ("import finetune.versions as v; v.TESTED['transformers'] = ('1.0.0', '1.0.1'); "
            "from finetune.commands.train import main; import sys; "
            f"sys.exit(main(['--recipe', 'tiny', '--dry-run', 'output_dir={tmp_path}/run']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    notes = [line for line in proc.stderr.splitlines() if line.startswith("note: transformers")]
    assert len(notes) == 1 and "newer than the newest release finetune is tested with (1.0.0 to 1.0.1)" in notes[0]
