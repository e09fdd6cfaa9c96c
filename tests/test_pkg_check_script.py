"""ci/pkg_check.sh as a vendor runs it, with a work folder relative to where it is called (bash with stand-in tools;
nothing is installed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASH = shutil.which("bash")

# Stands in for python: `-m venv DIR` makes DIR/bin/python and DIR/bin/hwgraph, which log their cwd and arguments;
# anything else (pip wheel) succeeds and does nothing.
FAKE_PYTHON = r"""#!/bin/sh
if [ "$1 $2" = "-m venv" ]; then
  mkdir -p "$3/bin"
  for tool in python hwgraph; do
    printf '#!/bin/sh\ncat >/dev/null\necho "$PWD $(basename "$0") $*" >> "%s"\n' "$LOG" > "$3/bin/$tool"
    chmod +x "$3/bin/$tool"
  done
fi
exit 0
"""


@pytest.mark.skipif(BASH is None, reason="ci/pkg_check.sh is a bash script; no bash on this machine")
@pytest.mark.parametrize("checkout", ["checkout", "my checkout"])
def test_pkg_check_sh_takes_a_relative_workdir(tmp_path, checkout):
    """`bash ci/pkg_check.sh out/pkg` built the wheels and the venv, then moved into out/pkg and ran
    out/pkg/venv/bin/python from there: `No such file or directory` (status 127) before any check ran. In a checkout
    whose path has a space (tox's pkg env passes a folder inside it), the venv's pip was split at the space: 127."""
    root = tmp_path / checkout
    (root / "ci").mkdir(parents=True)
    shutil.copy(ROOT / "ci" / "pkg_check.sh", root / "ci" / "pkg_check.sh")
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "python").write_text(FAKE_PYTHON)
    (tools / "python").chmod(0o755)
    log = tmp_path / "calls.log"
    done = subprocess.run([BASH, "ci/pkg_check.sh", "out/pkg"], cwd=root, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL,
                          env={"PATH": f"{tools}:/usr/bin:/bin", "LOG": str(log)})
    assert done.returncode == 0, done.stderr
    work = root / "out" / "pkg"
    calls = log.read_text().splitlines()
    assert f"{work} python -" in calls, calls  # the discovery check, run from the work folder
    assert f"{work} hwgraph info" in calls, calls
