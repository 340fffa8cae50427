"""Splits one full run of the suite into shards that run at once (``pytest --shard=K/N``).

``scripts/test.sh`` runs the suite as 2 pytest processes on CI's 2 cores: much of an e2e test is a
single-threaded start-up, a wait on a server or a daemon, or one rank waiting for the other, so two
shards fill the idle core. Each shard collects every test (the floors of tests/guards.py are
checked on the whole collection) and runs its share.

What goes together: tests are assigned by file, and files that read the same session- or
module-scoped fixture of ``tests/`` (a shared training run, the MLflow server, a SLURM cluster) go
to the same shard, so no shared run is built twice; the SLURM layer stays in one shard (its local
clusters claim port blocks). The groups are then balanced by their measured cost (``COSTS``,
refreshed with ``python -m tests.shards costs test-results/junit-*.xml``), largest first onto the
lighter shard, which makes the split deterministic for a given set of tests.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from tests import guards

COSTS_FILE = Path(__file__).with_name("assets") / "test_costs.json"
"""Seconds per test file in the last measured full run (JUnit ``time``: set-up included)."""
DEFAULT_COST_S = {"unit": 0.2, "dist": 15.0, "e2e": 30.0, "slurm": 30.0}
"""Per test, for a file not in ``COSTS`` yet."""


def parse(value: str) -> tuple[int, int]:
    """``K/N`` -> (K, N) with 1 <= K <= N."""
    try:
        k, n = (int(part) for part in value.split("/"))
    except ValueError:
        raise ValueError(f"--shard={value!r}: expected K/N, e.g. 1/2") from None
    if not 1 <= k <= n:
        raise ValueError(f"--shard={value!r}: K must be between 1 and N")
    return k, n


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def groups(items) -> list[list[str]]:
    """Test files, joined when they share an expensive fixture (union-find over fixture names)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a: str, b: str) -> None:
        parent[find(a)] = find(b)

    for item in items:
        path = _file(item.nodeid)
        find(path)
        if guards.layer(item.nodeid) == "slurm":
            union(path, "<slurm>")
        info = getattr(item, "_fixtureinfo", None)
        for name, defs in (info.name2fixturedefs.items() if info else ()):
            fixture = defs[-1]
            if fixture.scope in ("session", "package", "module") and str(fixture.baseid).startswith("tests"):
                union(path, f"<fixture {fixture.baseid}::{name}>")
    members: dict[str, list[str]] = defaultdict(list)
    for path in list(parent):
        if not path.startswith("<"):
            members[find(path)].append(path)
    return sorted(members.values())


def assign(items, n: int, costs: dict[str, float] | None = None) -> dict[str, int]:
    """Test file -> shard (0-based), balancing the groups' costs."""
    costs = load_costs() if costs is None else costs
    per_file: dict[str, float] = defaultdict(float)
    for item in items:
        path = _file(item.nodeid)
        if path not in costs:
            per_file[path] += DEFAULT_COST_S.get(guards.layer(item.nodeid) or "unit", 1.0)
    cost = lambda group: sum(costs.get(path, per_file[path]) for path in group)  # noqa: E731
    load, where = [0.0] * n, {}
    for group in sorted(groups(items), key=lambda g: (-cost(g), g)):
        shard = min(range(n), key=lambda s: (load[s], s))
        load[shard] += cost(group)
        where.update({path: shard for path in group})
    return where


def load_costs() -> dict[str, float]:
    return json.loads(COSTS_FILE.read_text()) if COSTS_FILE.is_file() else {}


def costs_from_junit(paths: list[str]) -> dict[str, float]:
    """Seconds per test file summed over JUnit reports (classname ``tests.e2e.test_x``)."""
    out: dict[str, float] = defaultdict(float)
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            name = case.get("classname") or ""
            parts = name.split(".")
            while parts and not parts[-1].startswith("test_"):
                parts.pop()  # a class inside the module
            if parts:
                out["/".join(parts) + ".py"] += float(case.get("time") or 0.0)
    return {k: round(v, 1) for k, v in sorted(out.items())}


def write_record(path: str, *, shard: str | None, collected: list[str], ran) -> None:
    """One shard's record for ``check``: every collected test id and the ids it ran."""
    Path(path).write_text(json.dumps({"shard": shard, "collected": list(collected), "ran": sorted(ran)}))


def check(paths: list[str]) -> list[str]:
    """What is wrong with the shards' records together (empty: the shards ran exactly the collected
    tests): shards that collected different tests, tests no shard ran, tests two shards ran, and
    tests run that were not collected."""
    records = [json.loads(Path(p).read_text()) for p in paths]
    collected = [set(r["collected"]) for r in records]
    problems = [f"{p}: collected {len(c ^ collected[0])} test(s) differently from {paths[0]}"
                for p, c in zip(paths[1:], collected[1:]) if c != collected[0]]
    where: dict[str, list[str]] = defaultdict(list)
    for path, record in zip(paths, records):
        for nodeid in record["ran"]:
            where[nodeid].append(path)
    every = set().union(*collected) if collected else set()
    lost = sorted(every - set(where))
    twice = sorted(n for n, ps in where.items() if len(ps) > 1)
    extra = sorted(set(where) - every)
    for label, ids in (("collected but run by no shard", lost), ("run by more than one shard", twice),
                       ("run but not collected", extra)):
        if ids:
            problems.append(f"{len(ids)} test(s) {label}: " + ", ".join(ids[:10]) + (" ..." if len(ids) > 10 else ""))
    return problems


def report(paths: list[str], *, top: int = 25) -> str:
    """The ``top`` slowest tests over the shards' JUnit reports, and the seconds per layer."""
    cases, layers = [], defaultdict(float)
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            seconds = float(case.get("time") or 0.0)
            nodeid = f"{(case.get('classname') or '').replace('.', '/')}.py::{case.get('name')}"
            cases.append((seconds, nodeid))
            layers[guards.layer(nodeid) or "other"] += seconds
    lines = [f"{top} slowest tests (set-up included) of {len(cases)}:"]
    lines += [f"{seconds:8.1f}s {nodeid}" for seconds, nodeid in sorted(cases, reverse=True)[:top]]
    lines.append("seconds per layer (summed over shards): "
                 + ", ".join(f"{name} {seconds:.0f}" for name, seconds in sorted(layers.items())))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    usage = ("usage: python -m tests.shards report JUNIT...   (the slowest tests and time per layer)\n"
             "       python -m tests.shards costs JUNIT...    (rewrites tests/assets/test_costs.json)\n"
             "       python -m tests.shards check RECORD...   (the shards ran exactly the collected tests)")
    if len(argv) < 2 or argv[0] not in ("report", "costs", "check"):
        print(usage, file=sys.stderr)
        return 2
    missing = [path for path in argv[1:] if not Path(path).is_file()]
    if missing:
        print(f"tests.shards: no {'record' if argv[0] == 'check' else 'JUnit report'} {missing}: a shard did not "
              f"finish", file=sys.stderr)
        return 1
    if argv[0] == "check":
        problems = check(argv[1:])
        total = len(set().union(*(json.loads(Path(p).read_text())["collected"] for p in argv[1:])))
        print("\n".join(f"tests.shards check: {p}" for p in problems) if problems else
              f"tests.shards check: the {len(argv) - 1} shards ran each of the {total} collected tests exactly once")
        return 1 if problems else 0
    if argv[0] == "report":
        print(report(argv[1:]))
    else:
        COSTS_FILE.write_text(json.dumps(costs_from_junit(argv[1:]), indent=1) + "\n")
        print(f"wrote {COSTS_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
