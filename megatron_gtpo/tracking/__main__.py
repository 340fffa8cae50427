"""``python -m megatron_gtpo.tracking {status,replay} RUN_DIR``: a run's tracking backlog, sent by hand.

``status`` prints the MLflow run, how many journal records are not in MLflow yet, and whether
the run was left RUNNING by a process that is gone. ``replay`` sends them (the training process
must be gone: it replays by itself while it lives, and at its next ``--resume``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from megatron_gtpo.tracking.journal import TERMINAL, Journal, backlog, locked_journal
from megatron_gtpo.tracking.publisher import Publisher, configure_http
from megatron_gtpo.tracking.tracker import FlushReport
from megatron_gtpo.tracking.uri import redact_uri
from megatron_gtpo.utils.configuration import ConfigError

log = logging.getLogger("megatron_gtpo")


def journal_root(path: str | Path) -> Path:
    """A run directory (its ``tracking/``) or a journal directory itself (a moved-aside one)."""
    path = Path(path)
    return path if (path / "state.json").exists() else path / "tracking"


def replay(path: str | Path, *, uri: str | None = None, timeout_s: float = 60.0, end: str | None = None,
           request_timeout_s: int = 5) -> FlushReport:
    """Publishes a journal whose process is gone, retrying for up to ``timeout_s``; ``end`` sets
    the final status of a run left RUNNING (FAILED or KILLED)."""
    configure_http(request_timeout_s)
    with locked_journal(journal_root(path)) as journal:
        changes = {"uri": uri} if uri else {}
        if end:
            changes.update(status=end, reason="closed by `megatron_gtpo.tracking replay` (its process was gone)")
        if changes:
            journal.update(**changes)
        deadline, delay, can_delete = time.monotonic() + timeout_s, 0.5, None
        while True:
            try:
                publisher = Publisher(journal)
                can_delete = publisher.can_delete
                publisher.pump()
                break
            except Exception as err:  # noqa: BLE001 - reported, retried until the deadline
                if time.monotonic() + delay > deadline:
                    log.error("tracking: %s still fails after %.0fs: %s", redact_uri(journal.snapshot().uri), timeout_s, err)
                    break
                time.sleep(delay)
                delay = min(2 * delay, 15.0)
        state = journal.snapshot()
        unsent, waiting = backlog(journal, state, can_delete=can_delete)
        return FlushReport(unsent=unsent, held=waiting, status_sent=state.published_status == state.status,
                           journal=journal.path)


def status(path: str | Path) -> str:
    """A few lines on the journal of ``path`` (a run directory or a journal directory)."""
    journal = Journal(journal_root(path))
    state = journal.load_state()
    if state is None:
        raise FileNotFoundError(f"{path} holds no tracking journal")
    unsent, _ = backlog(journal, state, can_delete=None)
    try:
        journal.acquire()
        journal.release()
        alive = False
    except ConfigError:
        alive = True
    owner = state.owner
    lines = [f"run        {state.run_id or '(not created yet)'} at {redact_uri(state.uri)} (experiment {state.experiment})",
             f"journal    {journal.path}: {unsent} record(s) not in MLflow, last checkpoint step {state.committed_step}",
             f"status     wanted {state.status}, in MLflow {state.published_status or '-'}"]
    if alive:
        lines.append(f"writer     live: pid {owner.get('pid')} on {owner.get('host')}")
    elif state.status not in TERMINAL:
        lines.append(f"writer     GONE: pid {owner.get('pid')} on {owner.get('host')} (started {owner.get('started')}) "
                     "ended without finishing the run (SIGKILL, OOM, node loss); `--resume` continues it, "
                     "`replay --end FAILED` closes it")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_gtpo.tracking", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["status", "replay"])
    parser.add_argument("run_dir", help="run directory (or a tracking journal directory)")
    parser.add_argument("--uri", help="send to this tracking URI instead of the journal's")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to keep retrying (replay)")
    parser.add_argument("--end", choices=[s for s in TERMINAL if s != "FINISHED"],
                        help="replay: also end a run left RUNNING with this status")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        if args.command == "status":
            print(status(args.run_dir))
            return 0
        report = replay(args.run_dir, uri=args.uri, timeout_s=args.timeout, end=args.end)
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{report.unsent} record(s) not in MLflow ({report.held} wait for a --resume); "
          f"status {'sent' if report.status_sent else 'NOT sent'}; journal {report.journal}")
    return 0 if report.unsent == report.held and report.status_sent else 1


if __name__ == "__main__":
    raise SystemExit(main())
