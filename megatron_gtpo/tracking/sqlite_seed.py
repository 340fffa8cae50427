"""A new run's SQLite tracking store, copied from a migrated empty one instead of migrated afresh.

MLflow creates a new SQLite store by running its ~50 alembic migrations (1.5-2 s of one core,
on the path to a run's first step, in every run). The result depends only on the MLflow and
SQLAlchemy versions, so the first run of an installation builds it once into the cache
(``$MEGATRON_GTPO_CACHE``, default ``~/.cache/megatron-gtpo``) and every later run copies it
(~5 ms). The copy holds the tables and no rows: MLflow inserts its default experiment (id 0,
whose artifact location is the opening store's own) when it opens the store, as in a fresh one.

A store that exists already is never touched, nor is any URI but a local ``sqlite:///`` file.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import tempfile
from pathlib import Path

log = logging.getLogger("megatron_gtpo")

PREFIX = "sqlite:///"
HEADER = b"SQLite format 3\x00"


def template_path(cache_dir: Path) -> Path:
    """The cached empty store of this MLflow and SQLAlchemy (the schema is theirs)."""
    import mlflow
    import sqlalchemy

    return cache_dir / f"mlflow-{mlflow.__version__}-sqlalchemy-{sqlalchemy.__version__}-empty.db"


def _build_template(path: Path) -> None:
    """Migrates an empty store in a temporary file, removes MLflow's default experiment (it names
    the builder's artifact root), and renames it into place: a reader never sees half of it."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".mlflow-template-") as tmp:
        db = Path(tmp) / "store.db"
        store = SqlAlchemyStore(PREFIX + str(db), str(Path(tmp) / "artifacts"))
        store.engine.dispose()
        with sqlite3.connect(db) as conn:
            conn.execute("DELETE FROM experiments")
        conn.close()
        os.replace(db, path)


def _is_sqlite(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(len(HEADER)) == HEADER
    except OSError:
        return False


def seed_sqlite_store(uri: str, cache_dir: Path) -> bool:
    """Creates the SQLite file of ``uri`` from the cached template when the file does not exist
    yet; True when it did. Anything that goes wrong leaves the file absent (MLflow then creates it
    the slow way) and is logged, never raised."""
    if not uri.startswith(PREFIX):
        return False
    target = Path(uri[len(PREFIX):].split("?", 1)[0])
    if target.exists() or not target.parent.is_dir():
        return False
    try:
        template = template_path(cache_dir)
        if not _is_sqlite(template):  # absent, or not a database (then rebuilt, not copied)
            _build_template(template)
        staged = target.with_name(f".{target.name}.seed-{os.getpid()}")
        shutil.copyfile(template, staged)
        try:
            os.link(staged, target)  # never over a store another process created meanwhile
        except FileExistsError:
            pass
        finally:
            staged.unlink(missing_ok=True)
        return True
    except Exception as err:  # noqa: BLE001 -- an optimisation: MLflow migrates the store itself
        log.warning("tracking: could not copy the empty MLflow store (%s); MLflow creates it", err)
        return False
