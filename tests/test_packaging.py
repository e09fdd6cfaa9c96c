"""What the four distributions ship in their sdists: the license they declare, and the tests (with what those need) so
that a packager can run them from the sdist alone."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
GIT = shutil.which("git")
pytestmark = pytest.mark.skipif(GIT is None or not (ROOT / ".git").exists(),
                                reason="copies the checkout's files as git lists them; no git checkout here")
DISTRIBUTIONS = {".": ("tests/conftest.py", "tests/plugins", "ci/env.sh", "tox.ini"),
                 "backends/cuda": ("tests/test_cuda_conformance.py",),
                 "backends/rocm": ("tests/test_rocm_conformance.py",),
                 "backends/npu": ("tests/test_npu_conformance.py",)}


class Sdist(NamedTuple):
    names: list[str]  # member names without the top folder
    pkg_info: str  # its PKG-INFO: the metadata an index shows


@pytest.fixture(scope="module")
def sdists(tmp_path_factory) -> dict[str, Sdist]:
    """Each distribution's sdist, built from a copy of the checkout so the build writes no egg-info beside the tests
    that run meanwhile."""
    work = tmp_path_factory.mktemp("sdist")
    listed = subprocess.run([GIT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (work / "src" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, work / "src" / name)
    members = {}
    for dist in DISTRIBUTIONS:
        out = work / "out" / dist.replace("/", "-")
        subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                        "b.build_sdist(sys.argv[1])", str(out)], cwd=work / "src" / dist, check=True,
                       capture_output=True, timeout=300)
        (archive,) = out.glob("*.tar.gz")
        with tarfile.open(archive) as tar:
            names = tar.getnames()
            (info,) = [m for m in names if m.count("/") == 1 and m.endswith("/PKG-INFO")]
            members[dist] = Sdist([m.split("/", 1)[1] for m in names if "/" in m],
                                  tar.extractfile(info).read().decode())
    return members


@pytest.mark.parametrize("dist", list(DISTRIBUTIONS))
def test_every_sdist_carries_its_license_and_its_tests(sdists, dist):
    names = sdists[dist].names
    assert "LICENSE" in names, f"{dist}: declares Apache-2.0 but ships no LICENSE"
    for needed in DISTRIBUTIONS[dist]:
        assert any(n == needed or n.startswith(needed + "/") for n in names), f"{dist}: sdist lacks {needed}"
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")], f"{dist}: sdist carries bytecode"


@pytest.mark.parametrize("dist", list(DISTRIBUTIONS))
def test_every_distribution_describes_itself_on_its_index_page(sdists, dist):
    """The README is the long description (what PyPI shows): each plugin names itself and what it provides."""
    assert "README.md" in sdists[dist].names, f"{dist}: sdist lacks README.md"
    info = sdists[dist].pkg_info
    assert "Description-Content-Type: text/markdown" in info, f"{dist}: no markdown long description"
    name = next(line.split(": ", 1)[1] for line in info.splitlines() if line.startswith("Name: "))
    body = info.split("\n\n", 1)[1]
    assert body.startswith(f"# {name}\n"), f"{dist}: long description does not start with the distribution's name"
    if dist != ".":
        assert "pytest backends/" in body and "tox -e" in body, f"{dist}: readme does not say how to test it"


def test_the_license_files_are_the_apache_2_0_text_they_declare():
    for dist in DISTRIBUTIONS:
        text = (ROOT / dist / "LICENSE").read_text()
        assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text, dist
        assert 'license = "Apache-2.0"' in (ROOT / dist / "pyproject.toml").read_text(), dist
