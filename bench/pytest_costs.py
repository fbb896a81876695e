"""pytest -p pytest_costs: per test (setup+call+teardown) wall seconds and CPU seconds of this process and
its waited-for children (launches), its start and end (epoch seconds t0, t1), pytest-xdist worker and venv,
one JSON line each to $COSTS_OUT."""
import json, os, resource, sys, time
import pytest

def _cpu():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    w0, (s0, c0) = time.monotonic(), _cpu()
    l0 = os.getloadavg()[0]
    yield
    w1, (s1, c1) = time.monotonic(), _cpu()
    path = os.environ.get("COSTS_OUT")
    if path:
        end = time.time()
        with open(path, "a") as f:
            f.write(json.dumps({"id": item.nodeid, "wall": round(w1 - w0, 2), "self_cpu": round(s1 - s0, 2),
                                "child_cpu": round(c1 - c0, 2), "load1": round(l0, 2),
                                "t0": round(end - (w1 - w0), 1), "t1": round(end, 1),
                                "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
                                "venv": os.path.basename(sys.prefix)}) + "\n")


# every launch (subprocess.run of finetune/run.py, accelerate launch, finetune.cli): argv, wall, child CPU
import subprocess as _sp
_orig_run = _sp.run
_current = {"id": None}

@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _current["id"] = item.nodeid

def _logged_run(cmd, *a, **kw):
    text = " ".join(map(str, cmd)) if isinstance(cmd, (list, tuple)) else str(cmd)
    if "finetune" not in text and "bench" not in text:
        return _orig_run(cmd, *a, **kw)
    w0, (_, c0) = time.monotonic(), _cpu()
    try:
        return _orig_run(cmd, *a, **kw)
    finally:
        w1, (_, c1) = time.monotonic(), _cpu()
        path = os.environ.get("COSTS_OUT")
        if path:
            env = kw.get("env") or {}
            with open(path + ".launches", "a") as f:
                f.write(json.dumps({"test": _current["id"], "cmd": text[-400:], "wall": round(w1 - w0, 2),
                                    "cpu": round(c1 - c0, 2), "fault": env.get("FINETUNE_FAULT"),
                                    "load1": round(os.getloadavg()[0], 2)}) + "\n")
_sp.run = _logged_run
