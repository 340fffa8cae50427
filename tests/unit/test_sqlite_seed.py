"""megatron_gtpo/tracking/sqlite_seed.py: a run's new SQLite store copied from the cached empty one
is the store MLflow would have migrated itself (same tables, indexes and schema version), MLflow's
default experiment names the opening store's artifact root (not the template builder's), a
store that exists is never touched, and a damaged template is rebuilt, not copied."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from megatron_gtpo.tracking.sqlite_seed import seed_sqlite_store, template_path


def schema(db: Path) -> tuple[list, list]:
    """What MLflow's migrations made: every table and index (with its SQL, as a set of lines: MLflow's
    own migrations list a table's constraints in varying order) and the alembic head."""
    with sqlite3.connect(db) as conn:
        objects = sorted((kind, name, sorted(line.strip().rstrip(",") for line in (sql or "").splitlines()))
                         for kind, name, sql in conn.execute("SELECT type, name, sql FROM sqlite_master "
                                                             "WHERE name NOT LIKE 'sqlite_%'"))
        head = conn.execute("SELECT version_num FROM alembic_version").fetchall()
    conn.close()
    return objects, head


def open_store(db: Path, artifacts: Path):
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    store = SqlAlchemyStore(f"sqlite:///{db}", str(artifacts))
    return store


@pytest.fixture(scope="module")
def migrated(tmp_path_factory) -> Path:
    """A store MLflow created itself (its migrations): the reference."""
    root = tmp_path_factory.mktemp("fresh")
    open_store(root / "mlflow.db", root / "artifacts").engine.dispose()
    return root / "mlflow.db"


def test_a_seeded_store_is_the_store_mlflow_migrates(tmp_path, migrated):
    """Catches a template of another schema (a stale cache, a migration left out) and a template
    that keeps its builder's default experiment (artifacts would go to the builder's directory)."""
    cache, db = tmp_path / "cache", tmp_path / "run" / "mlflow.db"
    db.parent.mkdir()
    assert seed_sqlite_store(f"sqlite:///{db}", cache) and template_path(cache).is_file()
    assert schema(db) == schema(migrated)
    store = open_store(db, tmp_path / "run" / "artifacts")
    (default,) = store.search_experiments()
    assert default.experiment_id == "0" and default.artifact_location == str(tmp_path / "run" / "artifacts" / "0")
    exp = store.create_experiment("e")
    run = store.create_run(exp, user_id="u", start_time=0, tags=[], run_name="r")
    assert store.get_run(run.info.run_id).info.experiment_id == exp


def test_an_existing_store_and_other_uris_are_left_alone(tmp_path):
    cache, db = tmp_path / "cache", tmp_path / "mlflow.db"
    db.write_bytes(b"the user's own store")
    assert not seed_sqlite_store(f"sqlite:///{db}", cache)
    assert db.read_bytes() == b"the user's own store" and not cache.exists()
    assert not seed_sqlite_store("http://127.0.0.1:5000", cache)
    assert not seed_sqlite_store("postgresql://u@h/db", cache)
    assert not seed_sqlite_store(f"sqlite:///{tmp_path}/absent_dir/mlflow.db", cache)  # MLflow says why
    assert not cache.exists()


def test_a_damaged_template_is_rebuilt_not_copied(tmp_path, migrated):
    """Catches copying whatever sits in the cache: a truncated file would become the run's store."""
    cache, db = tmp_path / "cache", tmp_path / "mlflow.db"
    cache.mkdir()
    template_path(cache).write_bytes(b"not a database")
    assert seed_sqlite_store(f"sqlite:///{db}", cache)
    assert schema(db) == schema(migrated) and schema(template_path(cache)) == schema(migrated)
