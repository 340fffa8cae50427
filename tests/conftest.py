"""Test-wide settings (offline hubs, quiet telemetry) and the full-run guards of tests/guards.py."""

import os

import pytest

from tests import guards, shards

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

_SKIPS: list[tuple[str, str]] = []
_RAN: set[str] = set()
"""Test ids this process ran (a set-up report: run, skipped or errored), for the shards' check."""

ENGINE_WRITES = ("LD_PRELOAD", "LD_LIBRARY_PATH")
"""What importing vLLM or starting an engine in this process writes into ``os.environ`` for later
processes: OpenCV (imported by vLLM) prepends its lib64 to LD_LIBRARY_PATH, vLLM's CPU platform
preloads tcmalloc and torch's libgomp for its workers. Restored around each test: a run a test
launches gets the user's environment, not an allocator or library path the tested code never asked
for (and the warm interpreter can serve it: tests/warm.py starts runs with changed LD_* fresh)."""
_SESSION_ENV = {key: os.environ.get(key) for key in ENGINE_WRITES}


def _restore_engine_writes() -> None:
    for key, value in _SESSION_ENV.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def _undo_engine_env_writes():
    _restore_engine_writes()
    yield
    _restore_engine_writes()


def _guarded() -> bool:
    return os.environ.get(guards.ENV) == "1"


_COLLECTED: list[str] = []
"""Every test id collected, before ``--shard`` keeps this shard's part: what the floors count."""


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run the K-th of N shards of the collected tests (tests/shards.py; scripts/test.sh runs 2)")
    parser.addoption("--shard-record", default=None, metavar="PATH",
                     help="write the collected and the ran test ids to PATH (JSON) at the end, for "
                          "`python -m tests.shards check` (scripts/test.sh)")


def pytest_collection_modifyitems(config, items):
    for item in items:  # the multi-rank and end-to-end layers start worlds, engines and servers
        if guards.layer(item.nodeid) in ("dist", "e2e", "slurm"):
            item.add_marker(pytest.mark.slow)
    _COLLECTED[:] = [item.nodeid for item in items]
    if config.getoption("shard"):
        try:
            k, n = shards.parse(config.getoption("shard"))
        except ValueError as err:
            raise pytest.UsageError(str(err)) from None
        where = shards.assign(items, n)
        mine = [where[item.nodeid.split("::", 1)[0]] == k - 1 for item in items]
        config.hook.pytest_deselected(items=[item for item, keep in zip(items, mine) if not keep])
        items[:] = [item for item, keep in zip(items, mine) if keep]


def pytest_collection_finish(session):
    _restore_engine_writes()  # what the test modules' imports wrote, before any fixture launches a run
    if not _guarded():
        return
    short = guards.below_floor(_COLLECTED)
    if short:
        raise pytest.UsageError("a layer of the suite is missing (tests/guards.py FLOORS):\n  " + "\n  ".join(short)
                                + f"\n(run a selection without the guards: {guards.ENV}=0)")


def pytest_runtest_logreport(report):
    if (reason := guards.skip_reason(report)) is not None and report.when in ("setup", "call"):
        _SKIPS.append((report.nodeid, reason))
    if report.when == "setup":
        _RAN.add(report.nodeid)


def _unexpected_skips() -> list[tuple[str, str]]:
    return [(nodeid, reason) for nodeid, reason in _SKIPS if guards.unexpected_skip(reason)] if _guarded() else []


def pytest_terminal_summary(terminalreporter):
    from tests.warm import WARM

    if line := WARM.summary():
        terminalreporter.line(line)
    if not _guarded():
        terminalreporter.line(guards.OFF_LINE)
    bad = _unexpected_skips()
    if bad:
        terminalreporter.section("skips not in tests/guards.py ALLOWED_SKIPS: the run fails", red=True)
        for nodeid, reason in bad:
            terminalreporter.line(f"{nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if path := session.config.getoption("shard_record"):
        shards.write_record(path, shard=session.config.getoption("shard"), collected=_COLLECTED, ran=_RAN)
    if _unexpected_skips() and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED  # a check that did not run is not a pass
