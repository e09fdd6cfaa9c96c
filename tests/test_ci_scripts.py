"""The ci/ scripts' environment rules (bash, with a stand-in venv and stand-in vendor tools; nothing is installed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CI = Path(__file__).resolve().parents[1] / "ci"
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="the ci/ scripts are bash scripts; no bash on this machine")


def checkout(tmp_path: Path, system_site_packages: bool | None) -> Path:
    """A checkout with ci/env.sh, ci/detect.sh and ci/parent_venv.sh, and a .venv made with or without the system's
    site-packages (None: no .venv) whose python accepts every command (so env.sh's pip calls do nothing)."""
    root = tmp_path / "checkout"
    (root / "ci").mkdir(parents=True)
    for name in ("env.sh", "detect.sh", "parent_venv.sh"):
        shutil.copy(CI / name, root / "ci" / name)
    if system_site_packages is not None:
        (root / ".venv" / "bin").mkdir(parents=True)
        python = root / ".venv" / "bin" / "python"
        python.write_text("#!/bin/sh\nexit 0\n")
        python.chmod(0o755)
        (root / ".venv" / "pyvenv.cfg").write_text(
            f"home = /usr/bin\ninclude-system-site-packages = {str(system_site_packages).lower()}\nversion = 3.11\n")
    return root


def source_env(root: Path, accel: str) -> subprocess.CompletedProcess:
    return subprocess.run([BASH, "-c", f"source ci/env.sh {accel} && echo sourced"], cwd=root, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("accel", ["cuda", "rocm", "npu"])
def test_a_cpu_venv_is_refused_for_an_accelerator_with_the_remedy(tmp_path, accel):
    """Reused, its CPU torch would run the accelerator's suite with every accelerator test skipped."""
    done = source_env(checkout(tmp_path, system_site_packages=False), accel)
    assert done.returncode == 2 and "sourced" not in done.stdout
    assert f"made for a CPU machine (its own torch), but {accel} needs the vendor's torch" in done.stderr
    assert "rm -rf .venv" in done.stderr


def test_an_accelerators_venv_is_refused_for_the_cpu_suite_with_the_remedy(tmp_path):
    done = source_env(checkout(tmp_path, system_site_packages=True), "cpu")
    assert done.returncode == 2 and "sourced" not in done.stdout
    assert "made for an accelerator (the system's torch), but cpu installs its own CPU torch" in done.stderr


@pytest.mark.parametrize("accel, system", [("cpu", False), ("cuda", True)])
def test_a_venv_made_for_this_kind_of_machine_is_reused(tmp_path, accel, system):
    done = source_env(checkout(tmp_path, system_site_packages=system), accel)
    assert done.returncode == 0 and done.stdout.strip() == "sourced", done.stderr


@pytest.mark.parametrize("tool, accel", [(None, "cpu"), ("nvidia-smi", "cuda"), ("rocm-smi", "rocm"),
                                         ("npu-smi", "npu")])
def test_the_detected_accelerator_is_the_vendor_tool_found(tmp_path, tool, accel):
    """ci/test.sh and ci/demo.sh default to it, so that both use the venv made for this machine."""
    root = checkout(tmp_path, system_site_packages=None)
    tools = tmp_path / "bin"
    tools.mkdir()
    if tool is not None:
        (tools / tool).write_text("#!/bin/sh\nexit 0\n")
        (tools / tool).chmod(0o755)
    # Only the stand-ins on the PATH (detect.sh runs no other command): a GPU machine has a real nvidia-smi.
    done = subprocess.run([BASH, "-c", 'source ci/detect.sh && echo "$DETECTED"'], cwd=root, capture_output=True,
                          text=True, timeout=60, env={"PATH": str(tools)})
    assert done.stdout.strip() == accel, done.stderr


@pytest.mark.parametrize("tools, accel", [({"nvidia-smi": 0, "rocm-smi": 2}, "cuda"),
                                          ({"nvidia-smi": 9, "rocm-smi": 0}, "rocm"),
                                          ({"rocm-smi": 2, "npu-smi": 0}, "npu"),
                                          ({"nvidia-smi": 9, "rocm-smi": 2, "npu-smi": 1}, "cpu")])
def test_a_vendor_tool_that_fails_does_not_decide_the_accelerator(tmp_path, tools, accel):
    """A rocm-smi left on a CUDA machine (it exits 2: no AMD GPU) made detect.sh say rocm, so ci/test.sh set up the
    ROCm env on a machine whose `nvidia-smi -L` listed its GPUs."""
    root = checkout(tmp_path, system_site_packages=None)
    folder = tmp_path / "bin"
    folder.mkdir()
    for tool, status in tools.items():
        (folder / tool).write_text(f"#!/bin/sh\nexit {status}\n")
        (folder / tool).chmod(0o755)
    done = subprocess.run([BASH, "-c", 'source ci/detect.sh && echo "$DETECTED"'], cwd=root, capture_output=True,
                          text=True, timeout=60, env={"PATH": str(folder)})
    assert done.stdout.strip() == accel, done.stderr


@pytest.mark.parametrize("script", ["test.sh", "demo.sh"])
def test_test_sh_and_demo_sh_default_to_the_detected_accelerator(tmp_path, script):
    """On a GPU machine whose .venv a CPU run made, both go for cuda and so meet env.sh's refusal (test.sh once
    defaulted to cpu and reused that venv, skipping every CUDA test)."""
    root = checkout(tmp_path, system_site_packages=False)
    shutil.copy(CI / script, root / "ci" / script)
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (tools / "nvidia-smi").chmod(0o755)
    for command in ("dirname", "sed", "tr"):  # what the scripts run up to the refusal; no vendor tool of this machine
        (tools / command).symlink_to(shutil.which(command))
    done = subprocess.run([BASH, f"ci/{script}"], cwd=root, capture_output=True, text=True, timeout=60,
                          env={"PATH": str(tools)})
    assert done.returncode == 2 and "but cuda needs the vendor's torch" in done.stderr, done.stderr


def vendor_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A venv standing in for the vendor's (the H200's /opt/torch/.venv), holding a stand-in torch: its python and
    the stand-in's file."""
    import sys

    parent = tmp_path / "vendor-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(parent)], check=True, timeout=120)
    site = subprocess.run([str(parent / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "torch").mkdir()
    (Path(site) / "torch" / "__init__.py").write_text("__version__ = 'vendor'\n")
    return parent / "bin" / "python", Path(site) / "torch" / "__init__.py"


def torch_seen_by(python: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-c", "import torch; print(torch.__version__, torch.__file__)"],
                          capture_output=True, text=True, timeout=60)


def test_an_accelerator_venv_sees_the_torch_of_the_venv_whose_python_makes_it(tmp_path):
    """The vendor's torch may live in a venv (the H200's is /opt/torch/.venv): a venv made from that venv's python
    sees the base interpreter's site-packages, not the venv's, and env.sh stopped with 'no torch for cuda in this
    environment'. It now adds the parent venv's site-packages (a .pth file)."""
    parent_python, torch_file = vendor_venv(tmp_path)
    root = checkout(tmp_path, system_site_packages=None)
    done = subprocess.run([BASH, "-c", "source ci/env.sh cuda"], cwd=root, capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/bin:/bin", "PYTHON": str(parent_python)})
    assert "no torch for cuda" not in done.stderr, done.stderr  # (the install after it fails: no project here)
    found = torch_seen_by(root / ".venv" / "bin" / "python")
    assert found.stdout.split() == ["vendor", str(torch_file)], found.stderr


def test_a_tox_env_sees_the_torch_of_the_venv_of_the_python3_on_path(tmp_path):
    """Found on the H200: `tox -e cuda` stopped at `No matching distribution found for torch>=2.10`. tox's env, made
    with the system's site-packages from the vendor venv's python, saw the base interpreter's site-packages only.
    The accelerator envs now run ci/parent_venv.sh first; tox puts its env's bin folder first on PATH, so the
    parent is the python3 found after it."""
    parent_python, torch_file = vendor_venv(tmp_path)
    env = tmp_path / "tox-env"  # what virtualenv makes with system_site_packages = true from the vendor's python
    subprocess.run([str(parent_python), "-m", "venv", "--without-pip", "--system-site-packages", str(env)],
                   check=True, timeout=120)
    assert torch_seen_by(env / "bin" / "python").returncode != 0  # the failure on the H200
    path = f"{env / 'bin'}:{parent_python.parent}:/usr/bin:/bin"
    done = subprocess.run([BASH, str(CI / "parent_venv.sh"), str(env / "bin" / "python")], capture_output=True,
                          text=True, timeout=120, env={"PATH": path})
    assert done.returncode == 0, done.stderr
    assert torch_seen_by(env / "bin" / "python").stdout.split() == ["vendor", str(torch_file)]


def test_parent_venv_adds_nothing_where_the_python_is_no_venvs(tmp_path):
    """A system python (no venv): its site-packages are the system's, which the env already sees."""
    import sys

    base = Path(sys.base_prefix) / "bin" / "python3"
    if not base.exists():
        pytest.skip(f"no base interpreter at {base}")
    env = tmp_path / "env"
    subprocess.run([str(base), "-m", "venv", "--without-pip", "--system-site-packages", str(env)], check=True,
                   timeout=120)
    done = subprocess.run([BASH, str(CI / "parent_venv.sh"), str(env / "bin" / "python")], capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHON": str(base)})
    assert done.returncode == 0, done.stderr
    assert not list(env.glob("lib/python*/site-packages/_hwgraph_parent_venv.pth"))


def test_parent_venv_removes_an_earlier_parent_no_longer_named(tmp_path):
    """A tox env is reused between runs: one run from the vendor venv, the next with PYTHON naming a python that is
    no venv's, must not keep the first run's parent."""
    import sys

    parent_python, _ = vendor_venv(tmp_path)
    env = tmp_path / "tox-env"
    subprocess.run([str(parent_python), "-m", "venv", "--without-pip", "--system-site-packages", str(env)],
                   check=True, timeout=120)
    script = [BASH, str(CI / "parent_venv.sh"), str(env / "bin" / "python")]
    for python in (parent_python, Path(sys.base_prefix) / "bin" / "python3"):
        done = subprocess.run(script, capture_output=True, text=True, timeout=120,
                              env={"PATH": "/usr/bin:/bin", "PYTHON": str(python)})
        assert done.returncode == 0, done.stderr
    assert torch_seen_by(env / "bin" / "python").returncode != 0


def test_parent_venv_names_what_it_expects(tmp_path):
    done = subprocess.run([BASH, str(CI / "parent_venv.sh"), str(tmp_path / "missing" / "python")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "expected an environment's python" in done.stderr, done.stderr


@pytest.mark.parametrize("accel", ["cuda", "rocm", "npu"])
def test_tox_accelerator_envs_prepare_through_accel_env_sh(accel):
    import configparser

    ini = configparser.ConfigParser(interpolation=None)
    ini.read(CI.parent / "tox.ini")
    section = ini[f"testenv:{accel}"]
    assert section["commands_pre"].strip() == f'bash ci/accel_env.sh {accel} "{{envtmpdir}}/wheels" "{{env_python}}"'
    assert section["system_site_packages"] == "true" and "PYTHON" in section["pass_env"].split()
    assert section["commands"].strip().endswith(f"-m {accel} tests backends {{posargs}}")


def test_accel_env_sh_installs_all_three_plugins_between_its_checks():
    """On the H200, `tox -e cuda` with only the cuda plugin failed to collect four modules that import the rocm or
    npu plugin (`ModuleNotFoundError: No module named 'hwgraph_npu'`), as ci/env.sh's venv never did."""
    steps = [line for line in (CI / "accel_env.sh").read_text().splitlines() if line and not line.startswith(("#", " "))
             and not line.startswith(("set ", "cd ", "if ", "fi", "ACCEL="))]
    assert steps == ['bash ci/parent_venv.sh "$ENV_PYTHON"', '"$ENV_PYTHON" ci/accel_check.py deps "$ACCEL"',
                     'PATH="$(dirname "$ENV_PYTHON"):$PATH" bash ci/install_extra.sh "$WHEELS" cuda,rocm,npu,test '
                     '--offline', '"$ENV_PYTHON" ci/accel_check.py machine "$ACCEL"']


def bare_env(tmp_path: Path) -> Path:
    """A venv of the base interpreter without the system's site-packages: no torch, no transformers, no pytest."""
    import sys

    env = tmp_path / "bare"
    subprocess.run([str(Path(sys.base_prefix) / "bin" / "python3"), "-m", "venv", "--without-pip", str(env)],
                   check=True, timeout=120)
    return env / "bin" / "python"


def test_accel_env_sh_names_every_missing_requirement_before_installing(tmp_path):
    """pip, offline, stopped at the first requirement it could not resolve (`No matching distribution found for
    transformers>=5.17`), after three setuptools warnings, without saying the env installs offline by design."""
    import sys

    if sys.version_info < (3, 11):
        pytest.skip("no tomllib before Python 3.11: the requirements are not checked")
    python = bare_env(tmp_path)
    done = subprocess.run([BASH, str(CI / "accel_env.sh"), "rocm", str(tmp_path / "wheels"), str(python)],
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": str(Path(sys.base_prefix) / "bin" / "python3")})
    assert done.returncode == 2, done.stderr
    for wanted in ("torch>=2.10.0a0 (not installed)", "transformers>=5.17 (not installed)", "pytest-xdist>=3 (not "
                   "installed)", "a ROCm build of torch", "PYTHON=/path/to/venv/bin/python tox -e rocm"):
        assert wanted in done.stderr, done.stderr
    assert not (tmp_path / "wheels").exists()  # stopped before building anything


def test_accel_check_names_a_requirement_too_old():
    import sys

    sys.path.insert(0, str(CI))
    try:
        import accel_check
    finally:
        sys.path.remove(str(CI))
    assert accel_check.unmet(["packaging>=1", "pytest>=9999", "surely-no-such-distribution>=1"]) == [
        f"pytest>=9999 (found {__import__('pytest').__version__})", "surely-no-such-distribution>=1 (not installed)"]


@pytest.mark.parametrize("accel", ["cuda", "rocm", "npu"])
def test_accel_check_refuses_a_machine_of_another_kind(accel):
    """Run on a machine without the accelerator, the env passed with every test skipped (136 for cuda here)."""
    import sys

    from hwgraph.platform import detect

    if detect().kind == accel:
        pytest.skip(f"this is a {accel} machine")
    done = subprocess.run([sys.executable, str(CI / "accel_check.py"), "machine", accel], cwd=CI.parent,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert f"hwgraph finds a {detect().kind} machine here" in done.stderr
    assert f"every {accel} test would be skipped" in done.stderr


@pytest.mark.parametrize("args", [["machine"], ["deps", "tpu"], ["install", "cuda"]])
def test_accel_check_names_what_it_expects(args):
    import sys

    done = subprocess.run([sys.executable, str(CI / "accel_check.py"), *args], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and "expected deps|machine cuda|rocm|npu" in done.stderr, done.stderr


def test_accel_env_sh_names_what_it_expects(tmp_path):
    done = subprocess.run([BASH, str(CI / "accel_env.sh"), "tpu", str(tmp_path), "/usr/bin/python3"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "expected cuda|rocm|npu WHEELDIR ENV_PYTHON" in done.stderr, done.stderr


def test_vllm_sh_fails_where_the_installed_vllm_does_not_import(tmp_path):
    """The vllm-marked modules `importorskip("vllm")`, which skips on any ModuleNotFoundError: where the venv's vllm is
    the pinned version (so vllm.sh installs nothing) but one of its dependencies is missing (a reused venv an
    interrupted install left), every vllm test was skipped ("vllm is not installed") and ci/vllm.sh, the second half
    of CI's `.ci/run`, exited 0 having checked nothing."""
    import sys

    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("import cbor2_not_installed\n")
    (site / "vllm-0.33.0.dist-info").mkdir()
    (site / "vllm-0.33.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n")
    venv = tmp_path / "venv-vllm"
    (venv / "bin").mkdir(parents=True)
    # Its python is this interpreter with the broken vllm on its path; pip does nothing.
    (venv / "bin" / "python").write_text(f'#!/bin/sh\n[ "$1 $2" = "-m pip" ] && exit 0\n'
                                         f'PYTHONPATH="{site}" exec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    done = subprocess.run([BASH, str(CI / "vllm.sh"), "-q", "-p", "no:cacheprovider"], capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HWGRAPH_VLLM_VENV": str(venv)})
    assert done.returncode != 0, done.stdout + done.stderr
    assert "No module named 'cbor2_not_installed'" in done.stderr, done.stderr
