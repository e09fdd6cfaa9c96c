"""Run the shipped conformance suite in this process against one backend and collect its results.

``hwgraph validate`` writes a small test module that star-imports the suite and names the backend, runs it with
``pytest.main`` and a collector plugin, and sends pytest's own output to a log file beside the report.
"""

from __future__ import annotations

import contextlib
import os
import sys
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path

OUTCOMES = ("passed", "failed", "error", "skipped")


@dataclass
class CheckResult:
    check: str  # "TestClass::test_name[case]": the name a failure is reported under
    outcome: str  # one of OUTCOMES
    message: str = ""
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def short_message(report) -> str:
    """The one-line cause: the crash message for failures, the reason for skips."""
    longrepr = report.longrepr
    if report.skipped and isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    text = getattr(crash, "message", None) or str(longrepr or "")
    lines = [line for line in text.splitlines() if line.strip()]
    return " ".join(lines[:3])[:600]


class ResultCollector:
    """A pytest plugin object: one ``CheckResult`` per test, in run order; advances ``progress`` per test."""

    def __init__(self, progress=None):
        self.results: dict[str, CheckResult] = {}
        self.progress = progress
        self.interrupted = False  # by Ctrl-C (a KeyboardInterrupt), which pytest catches and reports as status 2

    def pytest_keyboard_interrupt(self, excinfo):
        # also called for pytest.exit() and for the stop after a collection error (a KeyboardInterrupt subclass)
        import pytest

        ctrl_c = excinfo.errisinstance(KeyboardInterrupt) and not excinfo.errisinstance(pytest.Session.Interrupted)
        self.interrupted = self.interrupted or ctrl_c

    def pytest_collection_finish(self, session):
        if self.progress is not None:
            self.progress.set_total(len(session.items))

    def pytest_collectreport(self, report):
        if report.failed:
            self.results[report.nodeid] = CheckResult(report.nodeid or "collection", "error", short_message(report))

    def pytest_runtest_logreport(self, report):
        check = report.nodeid.split("::", 1)[-1]
        current = self.results.get(report.nodeid)
        if report.when == "call" or (report.when == "setup" and not report.passed):
            outcome = "error" if report.when == "setup" and report.failed else report.outcome
            self.results[report.nodeid] = CheckResult(check, outcome, "" if report.passed else short_message(report),
                                                      round(report.duration, 3))
        elif report.when == "teardown" and report.failed and current is not None and \
                current.outcome in ("passed", "skipped"):
            # pytest counts an error for it (a skipped check's fixtures still tear down: the manager's weights check)
            self.results[report.nodeid] = CheckResult(check, "error", "teardown: " + short_message(report))
        if report.when == "teardown" and self.progress is not None:
            self.progress.advance(note=check.split("[")[0])

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(OUTCOMES, 0)
        for r in self.results.values():
            out[r.outcome] += 1
        return out


def failing_checks(conformance: dict) -> list[dict]:
    """The results of ``run_conformance`` that failed or errored."""
    return [r for r in conformance["results"] if r["outcome"] in ("failed", "error")]


def suite_module(backend: str, preset: str, kernels: list[str] | None, dtype: str | None,
                 graph_mode: str | None = None) -> str:
    lines = ['"""Written by hwgraph validate: the shipped conformance suite against one backend."""', "",
             "from hwgraph.testing.suite import *  # noqa: F401,F403", "",
             f"HWGRAPH_BACKEND = {backend!r}", f"HWGRAPH_PRESET = {preset!r}"]
    if kernels:
        lines.append(f"HWGRAPH_ATTENTION = {tuple(k.upper() for k in kernels)!r}")
    if dtype:
        lines.append(f"HWGRAPH_DTYPE = {dtype!r}")
    if graph_mode:
        lines.append(f"HWGRAPH_GRAPH_MODE = {graph_mode!r}")
    return "\n".join(lines) + "\n"


PYTEST_ENVIRONMENT = ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")  # options and plugins pytest.main takes from the environment


def run_conformance(workdir: Path, backend: str, preset: str, kernels: list[str] | None = None,
                    dtype: str | None = None, progress=None, log_path: Path | None = None,
                    graph_mode: str | None = None) -> dict:
    """Run the suite; returns ``{"exit_code", "counts", "results": [CheckResult dicts], "log"}``. Only the arguments
    configure it: the suite's ``HWGRAPH_TEST_*`` environment variables are set aside while it runs. Ctrl-C during the
    run raises ``KeyboardInterrupt`` once it has stopped (pytest itself catches it and returns)."""
    import pytest

    from hwgraph.testing.cases import SUITE_ENVIRONMENT

    workdir.mkdir(parents=True, exist_ok=True)
    module = workdir / f"test_hwgraph_conformance_{backend}.py"
    module.write_text(suite_module(backend, preset, kernels, dtype, graph_mode))
    ini = workdir / "pytest.ini"
    # pytest marks each plugin distribution's top package for rewrite (hwgraph, anyio), already imported in this
    # process: harmless, as only the suite's asserts matter and rewrite_suite_asserts registered it before its import
    rewrite = r"Module already imported so cannot be rewritten; (?!hwgraph\.testing\.suite$)"
    ini.write_text(textwrap.dedent(f"""\
        [pytest]
        addopts = -ra
        filterwarnings =
            ignore:{rewrite}:pytest.PytestAssertRewriteWarning
        """))
    log_path = log_path or workdir / "conformance.log"
    collector = ResultCollector(progress)
    args = [str(module), "-c", str(ini), "--rootdir", str(workdir), "--import-mode=importlib",
            "-p", "no:cacheprovider", "-o", "console_output_style=classic"]
    # validate's own options define the run: a vendor's HWGRAPH_TEST_* settings, meant for its own pytest run, must
    # neither narrow the explicit backend nor replace validate's defaults (every kernel, the platform's dtype).
    # Nor may pytest's own variables: PYTEST_ADDOPTS="-k ..." or "--deselect" would narrow the checks validate counts.
    saved = {name: os.environ.pop(name) for name in (*SUITE_ENVIRONMENT, *PYTEST_ENVIRONMENT) if name in os.environ}
    # pytest's importlib mode imports the module under its file's stem and keeps it in sys.modules: a second run in
    # this process (other kernels, another dtype) would run the first run's module instead of the one just written
    sys.modules.pop(module.stem, None)
    try:
        with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            code = pytest.main(args, plugins=[collector])
    finally:
        os.environ.update(saved)
        sys.modules.pop(module.stem, None)
    if collector.interrupted:  # the caller stops too (validate ran its benchmark next), as on Ctrl-C anywhere else
        raise KeyboardInterrupt(f"the conformance suite was interrupted; its output so far is in {log_path}")
    return {"exit_code": int(code), "counts": collector.counts(), "log": str(log_path),
            "results": [r.as_dict() for r in collector.results.values()]}
