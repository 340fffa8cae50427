"""Where the records go: resolving ``tracking.uri`` and checking, before any rank starts, that it answers.

Credentials come from the environment (MLflow reads ``MLFLOW_TRACKING_USERNAME`` /
``MLFLOW_TRACKING_PASSWORD`` / ``MLFLOW_TRACKING_TOKEN``; a SQL store's password may sit in
``$MLFLOW_TRACKING_URI``, which is never written anywhere): ``tracking.uri`` itself, which goes into
config.yaml and the MLflow params, may not hold a password, and every message that names a URI
shows it through :func:`redact_uri`."""

from __future__ import annotations

import os
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse, urlsplit

from megatron_gtpo.utils.configuration import ConfigError

SQL_SCHEMES = ("postgresql", "mysql", "mssql")
_DEFAULT_PORTS = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}


def uri_password(uri: str) -> str | None:
    """The password in a URI's ``user:password@`` part, if any."""
    try:
        return urlsplit(uri).password
    except ValueError:
        return None


def redact_uri(uri: str | None) -> str | None:
    """``uri`` with the password of its ``user:password@`` part replaced by ``***`` (for messages)."""
    password = uri_password(uri) if uri else None
    return uri.replace(f":{password}@", ":***@", 1) if password else uri


def resolve_uri(uri: str | None, output_dir: str | os.PathLike) -> str:
    """Config URI, else $MLFLOW_TRACKING_URI, else a SQLite file in the run directory."""
    if uri:
        return uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"


def resolve_experiment(name: str | None) -> str:
    """Config experiment, else $MLFLOW_EXPERIMENT_NAME, else 'megatron-gtpo'."""
    return name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "megatron-gtpo"


def check_tracking_uri(uri: str, timeout_s: float = 5.0) -> str:
    """Checks within ``timeout_s`` that the tracking store can be used; returns a one-line
    description. Raises ConfigError naming ``tracking.uri`` and the fix when it cannot.

    http(s): something answers ``GET <uri>/health`` (any status below 500); sqlite / file / a
    plain path: the database file or directory is writable (or can be created); postgresql /
    mysql / mssql: the host accepts a TCP connection. Other schemes (databricks ...) pass unchecked.
    """
    scheme = urlparse(uri).scheme.split("+")[0]
    if scheme in ("http", "https"):
        _bounded(lambda: _check_http(uri, timeout_s), uri, timeout_s)
        return f"{redact_uri(uri)} (answers)"
    if scheme == "sqlite":
        path = uri.split("sqlite:///", 1)[1] if uri.startswith("sqlite:///") else ""
        if path and not path.startswith(":memory:"):
            _check_writable(Path(path.split("?")[0]), uri)
        return f"{redact_uri(uri)} (writable)"
    if scheme in ("file", ""):
        if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1"):
            raise ConfigError(f"tracking.uri={redact_uri(uri)!r}: MLflow 3 refuses file stores unless MLFLOW_ALLOW_FILE_STORE=true "
                              "is exported; use a SQLite store (sqlite:///path/mlflow.db, or leave tracking.uri unset "
                              "for one in the run directory)")
        _check_writable(Path(urlparse(uri).path if scheme else uri) / "x", uri)
        return f"{redact_uri(uri)} (writable)"
    if scheme in SQL_SCHEMES:
        parsed = urlparse(uri)
        _bounded(lambda: socket.create_connection((parsed.hostname or "localhost",
                                                   parsed.port or _DEFAULT_PORTS[scheme]), timeout_s).close(),
                 uri, timeout_s)
        return f"{redact_uri(uri)} (port open)"
    return f"{redact_uri(uri)} (not checked)"


def _fix(uri: str) -> str:
    return (f"start the MLflow server (e.g. `mlflow server --host 127.0.0.1 --port {urlparse(uri).port or 5000}`), "
            "correct tracking.uri (or $MLFLOW_TRACKING_URI, used when tracking.uri is unset), leave both unset "
            "for a SQLite store in the run directory, or set tracking.enabled=false")


def _check_http(uri: str, timeout_s: float) -> None:
    url = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            status = response.status
    except urllib.error.HTTPError as err:  # it answered, with an error status
        status = err.code
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise ConfigError(f"tracking.uri={redact_uri(uri)!r}: nothing answers at {redact_uri(url)} ({reason}); {_fix(uri)}") from None
    if status >= 500:
        raise ConfigError(f"tracking.uri={redact_uri(uri)!r}: {redact_uri(url)} answered HTTP {status} (server error); {_fix(uri)}")


def _bounded(check, uri: str, timeout_s: float) -> None:
    """Runs ``check`` in a thread and gives up after ``timeout_s`` (name lookups ignore socket timeouts)."""
    errors: list[BaseException] = []

    def run():
        try:
            check()
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            errors.append(err)

    thread = threading.Thread(target=run, name="tracking-uri-check", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise ConfigError(f"tracking.uri={redact_uri(uri)!r}: no answer within {timeout_s:g}s; {_fix(uri)}")
    if errors:
        if isinstance(errors[0], ConfigError):
            raise errors[0]
        raise ConfigError(f"tracking.uri={redact_uri(uri)!r}: cannot connect ({errors[0]}); {_fix(uri)}")


def _check_writable(path: Path, uri: str) -> None:
    """``path`` (a file that may not exist yet) can be written: it is writable, or its nearest
    existing ancestor is a writable directory."""
    target = path if path.exists() else path.parent
    while not target.exists() and target != target.parent:
        target = target.parent
    if not os.access(target, os.W_OK) or (target.exists() and not target.is_dir() and target != path):
        raise ConfigError(f"tracking.uri={redact_uri(uri)!r}: {target} is not writable; choose a writable location "
                          "(or leave tracking.uri unset for a SQLite store in the run directory)")
