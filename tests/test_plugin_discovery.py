"""End-to-end plugin discovery: a separately installed distribution's entry point becomes a graph backend."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

DUMMY = Path(__file__).parent / "plugins" / "dummy"

CHECK = """
import json, sys
from hwgraph import registry
specs, problems = registry.discovered()
dummy = registry.spec_named("dummy")
report = {
    "names": [s.name for s in specs],
    "problems": list(problems),
    "distribution": dummy.distribution,
    "loaded_before_choice": "hwgraph_dummy.graphs" in sys.modules,
    "auto": registry.choose_backend().spec.name,
}
backend = registry.create_backend("dummy")
report["loaded_after_choice"] = "hwgraph_dummy.graphs" in sys.modules
report["created"] = [type(backend).__module__, type(backend).__name__, backend.name, backend.mode]
from hwgraph.versions import environment
report["packages"] = environment()["packages"]
print(json.dumps(report))
"""


def test_an_installed_plugin_is_discovered_and_loaded_only_when_chosen(tmp_path, monkeypatch):
    from hwgraph.registry import choose_backend

    monkeypatch.delenv("HWGRAPH_GRAPH_BACKEND", raising=False)
    without_dummy = choose_backend().spec.name  # cpu here; the GPU's backend on a GPU machine
    source = tmp_path / "src"
    shutil.copytree(DUMMY, source)  # build outside the repository, so no build/ or egg-info lands in it
    probe = source / "hwgraph_dummy" / "platform.py"
    without_distribution = probe.read_text().replace('        distribution="hwgraph-backend-dummy",\n', "")
    assert without_distribution != probe.read_text()
    probe.write_text(without_distribution)  # the registry takes it from the entry point's distribution
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                    "--quiet", "--target", str(target), str(source)], check=True, capture_output=True, timeout=300)
    assert (target / "hwgraph_dummy" / "platform.py").exists()

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))}
    env.pop("HWGRAPH_GRAPH_BACKEND", None)
    result = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])

    assert "dummy" in report["names"]
    assert report["problems"] == []
    assert report["distribution"] == "hwgraph-backend-dummy"
    assert report["loaded_before_choice"] is False
    assert report["auto"] == without_dummy, "a lower-priority plugin does not displace the automatic choice"
    assert report["loaded_after_choice"] is True
    assert report["created"] == ["hwgraph_dummy.graphs", "DummyGraphBackend", "dummy", "emulated"]
    assert report["packages"]["hwgraph-backend-dummy"] == "0.1.0", "reports name the plugins' versions"
    assert report["packages"]["torch"] is not None
