"""Every ``sbatch ... slurm/*.sbatch`` launch line the docs give (configs/gpu/*.yaml headers, README.md,
docs/*.md, slurm/README.md, the scripts' own headers), submitted as written with ``sbatch --test-only``
to one real local SLURM of 6 nodes x 8 fake GPUs: SLURM must accept it and give it the nodes it names;
a train.sbatch line must name them with ``--nodes`` (sbatch reads no NODES variable), and where its
recipe and overrides are concrete, tp x pp x dp of the recipe must equal the ranks the job starts.

The lines are read from the files (code blocks of the Markdown files; the ``# Launch:`` line of a
recipe header; the ``#   sbatch`` examples of a script header), with the shell variables the same
file assigns expanded, so a doc edit that breaks a launch line fails here."""

from __future__ import annotations

import re
import shlex
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e.slurm_harness import LocalSlurm, local_slurm, requires_slurm
from tests.helpers import REPO

pytestmark = [requires_slurm, pytest.mark.slow]

NODES, GPUS = 6, 8
"""The local cluster: as large as the largest launch line (the 32B pool recipe: 4 trainer + 2 rollout nodes)."""
SOURCES = [*sorted((REPO / "configs" / "gpu").glob("*.yaml")), REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
           REPO / "slurm" / "README.md", *sorted((REPO / "slurm").glob("*.sbatch"))]
ASSIGNMENT = re.compile(r"^([A-Z_][A-Z0-9_]*)=(.*)$")


@dataclass
class LaunchLine:
    """One sbatch command as a doc writes it."""

    where: str
    """file:line"""
    env: dict[str, str]
    """Variables assigned before ``sbatch`` (ROLLOUT_NODES=2 ...)."""
    options: list[str]
    """sbatch options, before the script."""
    script: str
    """slurm/<name>.sbatch"""
    args: list[str] = field(default_factory=list)
    """The script's arguments (recipe and overrides for train.sbatch)."""

    def option(self, name: str) -> str | None:
        values = [o.split("=", 1)[1] for o in self.options if o.startswith(f"{name}=")]
        return values[-1] if values else None


def _joined(lines: list[str]) -> list[tuple[int, str]]:
    """(first line number, text) with backslash continuations joined."""
    out, start, buf = [], None, ""
    for number, line in lines:
        if start is None:
            start = number
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        out.append((start, buf + line))
        start, buf = None, ""
    return out


def _candidate_lines(path: Path) -> list[tuple[int, str]]:
    text = path.read_text().splitlines()
    numbered = list(enumerate(text, 1))
    if path.suffix == ".md":
        block, inside = [], False
        for number, line in numbered:
            if line.lstrip().startswith("```"):
                inside = not inside
            elif inside:
                block.append((number, line))
        return _joined(block)
    if path.suffix == ".yaml":
        return [(n, line.split("# Launch:", 1)[1]) for n, line in numbered if line.startswith("# Launch:")]
    return [(n, line[1:]) for n, line in numbered if line.startswith("#   ") and "sbatch " in line]


def _variables(path: Path) -> dict[str, str]:
    """Shell variables a doc assigns in its code blocks (LLAMA="..."), for the lines that use them."""
    out = {}
    for _, line in _candidate_lines(path) if path.suffix == ".md" else []:
        match = re.match(r'^\s*([A-Z_][A-Z0-9_]*)="([^"]*)"', line)
        if match:
            out[match.group(1)] = " ".join(match.group(2).split())
    return out


def launch_lines() -> list[LaunchLine]:
    found = []
    for path in SOURCES:
        variables = _variables(path)
        for number, line in _candidate_lines(path):
            line = re.sub(r"\$\{?([A-Z_][A-Z0-9_]*)\}?", lambda m: variables.get(m.group(1), m.group(0)), line)
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            if "sbatch" not in words:
                continue
            at = words.index("sbatch")
            env = dict(ASSIGNMENT.match(w).groups() for w in words[:at] if ASSIGNMENT.match(w))
            rest = words[at + 1:]
            options = []
            while rest and rest[0].startswith("-"):
                options.append(rest.pop(0))
            if not rest or not re.fullmatch(r"slurm/\w+\.sbatch", rest[0]):
                continue  # a usage line (sbatch [SBATCH OPTIONS] ...), not a launch line
            found.append(LaunchLine(where=f"{path.relative_to(REPO)}:{number}", env=env, options=options,
                                    script=rest[0], args=rest[1:]))
    return found


LINES = launch_lines()


@pytest.fixture(scope="module")
def big_cluster():
    root = Path(tempfile.mkdtemp(prefix="mgtpo-launch-"))
    root.chmod(0o755)
    try:
        with local_slurm(root / "cluster", nodes=NODES, gpus=GPUS, cpus=2) as cluster:
            yield cluster
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_launch_line_every_source_is_read():
    """The parser finds the lines it is meant to check (so the tests below cannot pass by reading nothing)."""
    where = {line.where.split(":")[0] for line in LINES}
    for recipe in (REPO / "configs" / "gpu").glob("*.yaml"):
        assert str(recipe.relative_to(REPO)) in where, recipe
    assert {"README.md", "docs/reproduce.md", "slurm/README.md", "slurm/train.sbatch"} <= where
    assert len(LINES) >= 25 and {line.script for line in LINES} == {f"slurm/{s}.sbatch" for s in
                                                                     ("train", "eval", "convert")}


def _default_nodes(script: str) -> int:
    match = re.search(r"^#SBATCH --nodes=(\d+)", (REPO / script).read_text(), re.M)
    return int(match.group(1))


def _earlier_job(cluster: LocalSlurm) -> str:
    """A held job standing in for the job a doc's chain names by a shell variable ($j of ``j=$(sbatch ...)``)."""
    out = cluster.run("sbatch", "--parsable", "--hold", "--nodes=1", "--wrap=true", cwd=REPO).stdout
    return out.strip().split(";")[0]


def _options(cluster: LocalSlurm, line: LaunchLine) -> list[str]:
    """The line's options as the shell hands them to sbatch: a dependency on ``$var`` names a real earlier job."""
    return [re.sub(r"\$\{?[a-z_][a-z0-9_]*\}?", lambda _: _earlier_job(cluster), o) if o.startswith("--dependency=")
            else o for o in line.options]


def _allocated_nodes(cluster: LocalSlurm, line: LaunchLine) -> int:
    proc = cluster.run("sbatch", "--test-only", *_options(cluster, line), line.script, *line.args, cwd=REPO,
                       env=line.env, check=False)
    assert proc.returncode == 0 and "to start at" in proc.stderr, f"{line.where}: SLURM refused it: {proc.stderr}"
    nodelist = re.search(r" on nodes (\S+) in partition", proc.stderr).group(1)
    return len(cluster.run("scontrol", "show", "hostnames", nodelist).stdout.split())


def _ranks_per_node(line: LaunchLine) -> int:
    gpus = int(line.env.get("GPUS_PER_NODE") or line.option("--gpus-per-node") or GPUS)
    return int(line.env.get("NPROC_PER_NODE") or (gpus if gpus > 0 else 1))


def _array_tasks(line: LaunchLine) -> list[int]:
    """The task ids of ``--array=0-3`` / ``--array=0,2`` (``%N`` throttles dropped); [] when not an array job."""
    spec = (line.option("--array") or "").split("%")[0]
    tasks = []
    for part in filter(None, spec.split(",")):
        first, _, last = part.partition("-")
        tasks += list(range(int(first), int(last or first) + 1))
    return tasks


def _task_args(line: LaunchLine, task: int | None) -> list[str]:
    """The script's arguments for one array task, as train.sbatch builds them: ``%a`` is the task id, and
    ARRAY_OVERRIDES' task-th ``;`` group follows the line's own overrides."""
    if task is None:
        return line.args
    groups = [g.split() for g in line.env.get("ARRAY_OVERRIDES", "").split(";")] if "ARRAY_OVERRIDES" in line.env else []
    return [a.replace("%a", str(task)) for a in line.args] + (groups[task] if groups else [])


def _worlds_of(line: LaunchLine) -> list[int] | None:
    """tp x pp x dp of the line's recipe and overrides, one per array task; None where the line is a template
    (RECIPE, ...)."""
    from megatron_gtpo.config import load_config

    worlds = []
    for task in _array_tasks(line) or [None]:
        args = _task_args(line, task)
        recipe, overrides = args[0] if args else "", args[1:]
        if not (REPO / recipe).is_file() or not all("=" in a and not a.startswith("[") for a in overrides):
            return None
        worlds.append(load_config(str(REPO / recipe), overrides).parallel.world_size)
    return worlds


@pytest.mark.parametrize("line", LINES, ids=lambda line: line.where)
def test_launch_line_gets_the_nodes_it_names(big_cluster, line):
    named = line.option("--nodes")
    if line.script == "slurm/train.sbatch":
        assert named is not None, (f"{line.where}: name the node count with sbatch --nodes=N"
                                   + (f" (NODES={line.env['NODES']} is read by nothing)" if "NODES" in line.env else ""))
    expected = int(named or line.env.get("NODES") or _default_nodes(line.script))
    got = _allocated_nodes(big_cluster, line)
    assert got == expected, f"{line.where}: names {expected} node(s), SLURM gives the job {got}"
    if line.script != "slurm/train.sbatch" or (worlds := _worlds_of(line)) is None:
        return
    trainer_nodes = got - int(line.env.get("ROLLOUT_NODES", 0))
    ranks = trainer_nodes * _ranks_per_node(line)
    for world in worlds:
        assert ranks == world, (f"{line.where}: {trainer_nodes} trainer node(s) x {_ranks_per_node(line)} ranks = "
                                f"{ranks}, but the recipe's tp x pp x dp = {world}")


def test_launch_line_array_tasks_read_as_train_sbatch_does():
    """The array substitution above mirrors train.sbatch (``%a`` and the i-th ARRAY_OVERRIDES group); without it
    ``train.seed=%a`` reached the config loader as a string (the failure it was written against)."""
    line = LaunchLine(where="x", env={"ARRAY_OVERRIDES": "algo.entropy_threshold=0.6 ; algo.entropy_threshold=0.7"},
                      options=["--nodes=2", "--array=0-1"], script="slurm/train.sbatch",
                      args=["configs/gtpo.yaml", "train.seed=%a"])
    assert _array_tasks(line) == [0, 1]
    assert _task_args(line, 1) == ["configs/gtpo.yaml", "train.seed=1", "algo.entropy_threshold=0.7"]
    script = (REPO / "slurm" / "train.sbatch").read_text()
    assert '"${@//%a/$SLURM_ARRAY_TASK_ID}"' in script and "ARRAY_OVERRIDES" in script
