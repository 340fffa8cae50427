"""Every cheap ``megatron-gtpo`` command the README and docs show runs as written.

The commands are read from the ```` ```bash ```` blocks of README.md, docs/*.md and */README.md
(continuation lines joined, trailing comments dropped) and from the ``$ megatron-gtpo ...`` lines of
their output blocks. Run: ``--help``, ``config``, ``dry-run`` and ``train ... --dry-run``. Skipped on
purpose (``SKIPS`` says why for each kind): commands with placeholders (``...``, ``RECIPE``,
``HF_DIR``, ``$VAR``), and commands that train, evaluate, probe or convert (minutes and model
weights; the e2e layer runs each of those from its own recipe).

An output block's command must exit as its printed output says: 1 when it shows ``REJECTED``, else 0.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from megatron_gtpo import cli
from tests.helpers import REPO, child_env

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(REPO.glob("*/README.md"))]

SKIPS = [
    (r"\.\.\.|\b[A-Z][A-Z_]{2,}\b|\$", "placeholder (`...`, RECIPE, HF_DIR, $VAR): not runnable as written"),
    (r"^(train|demo|probe|eval|convert|rollout-server)\b(?!.*(--dry-run|--help))",
     "trains, evaluates, probes or converts: minutes and weights, run by the e2e layer from its own recipes"),
]
"""(pattern over the arguments after ``megatron-gtpo``, why the command is not run here)."""


def documented_commands() -> list[tuple[str, str, int]]:
    """``(where, arguments after megatron-gtpo, expected exit status)`` for every documented command."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for block in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            where = f"{doc.relative_to(REPO)}:{text.count(chr(10), 0, block.start()) + 1}"
            body = block.group(2).replace("\\\n", " ")
            # an output block: each `$ command` with the lines it printed, up to the next `$`
            pieces = ([(line, 0) for line in body.splitlines()] if block.group(1) == "bash" else
                      [(p.split("\n", 1)[0], 1 if "REJECTED" in p else 0)
                       for p in re.split(r"^\$ ", body, flags=re.M)[1:]])
            for line, code in pieces:
                line = re.split(r"\s#\s", line.strip(), maxsplit=1)[0].strip()
                if m := re.match(r"(?:\.venv/bin/)?megatron-gtpo\s*(.*)$", line):
                    found.append((where, m.group(1), code))
    return found


def skip_reason(args: str) -> str | None:
    return next((why for pattern, why in SKIPS if re.search(pattern, args)), None)


COMMANDS = documented_commands()
RUN = [(where, args, code) for where, args, code in COMMANDS if skip_reason(args) is None]


def test_the_docs_show_commands_of_each_kind():
    """Guards the extraction: a changed fence or prompt format would otherwise leave nothing to run.
    Injected bug: the regex looking for ```bash only (output blocks' `$ megatron-gtpo` lines lost)
    -> fewer than 6 dry-runs with an expected status, fails."""
    kinds = {args.split()[0] if args else "--help" for _, args, _ in RUN}
    assert {"--help", "config", "dry-run", "train"} <= kinds, kinds
    assert sum(1 for _, a, _ in RUN if a.startswith("dry-run")) >= 6, RUN


@pytest.mark.parametrize("where,args,code", RUN, ids=[f"{w} {a[:60]}" for w, a, _ in RUN])
def test_documented_command_runs_as_written(where, args, code, capsys, monkeypatch):
    """The README's `dry-run configs/gtpo.yaml --nodes 2 --gpus-per-node 8` exited 1 (base.yaml set
    parallel.dp=1 and the dry-run did not derive DP from the GPUs). Injected bug: `sets_dp` always
    True -> that README line exits 1, fails."""
    argv = shlex.split(args)
    if argv[:1] == ["train"]:  # `train` leaves through os._exit (cli/__init__.py): its own process
        proc = subprocess.run([sys.executable, "-m", "megatron_gtpo.cli", *argv], cwd=REPO, env=child_env(),
                              capture_output=True, text=True, timeout=600)
        status, out = proc.returncode, proc.stdout[-3000:] + proc.stderr[-3000:]
    else:  # in this process: the same main() the console script calls, without ~10 s of imports each
        monkeypatch.chdir(REPO)
        try:
            status = cli.main(argv)
        except SystemExit as exit_:  # argparse's --help and usage errors
            status = exit_.code
        captured = capsys.readouterr()
        out = captured.out[-3000:] + captured.err[-3000:]
    assert status == code, f"{where}: megatron-gtpo {args}\nexit {status}, documented {code}\n{out}"
