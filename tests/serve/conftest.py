"""Fixtures of the serve tests."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

# A stand-in `vllm` on PATH: records its argv, pid and environment, then exits as told (FAKE_VLLM_EXIT),
# after sleeping (FAKE_VLLM_SLEEP) or on SIGTERM.
FAKE_VLLM = """#!{python}
import json, os, signal, sys, time
record = os.environ["FAKE_VLLM_RECORD"]
def write(extra):
    with open(record, "w") as handle:
        json.dump({{"argv": sys.argv, "pid": os.getpid(), "env": dict(os.environ), **extra}}, handle)
def on_term(signum, frame):
    write({{"signal": signum}})
    sys.exit(143)
signal.signal(signal.SIGTERM, on_term)
write({{}})
if os.environ.get("FAKE_VLLM_SLEEP"):
    time.sleep(float(os.environ["FAKE_VLLM_SLEEP"]))
sys.exit(int(os.environ.get("FAKE_VLLM_EXIT", "0")))
"""


@pytest.fixture
def fake_vllm(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "vllm"
    script.write_text(FAKE_VLLM.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_VLLM_RECORD": str(tmp_path / "record.json")}
