"""Errors that cross the rollout/sync boundary (a neutral home: neither package imports the other for them).

* :class:`WeightPushError`: a weight push was refused before it reached vLLM (or aborted on every
  server); the engines keep serving their previous version. Raised by the push checks
  (``sync/checks.py``) and by a rollout server's answer (``rollout/pool.py``).
* :class:`ServerError`: a rollout server could not be reached, died, timed out, refused this job, or
  failed a request for another reason (``rollout/pool.py``).
"""

from __future__ import annotations


class WeightPushError(RuntimeError):
    """A push was rejected before it reached vLLM; the engine still serves its previous version."""


class ServerError(RuntimeError):
    """A rollout server could not be reached, died, timed out, refused this job or failed a request."""
