"""``python -m megatron_gtpo.cli SUBCOMMAND ...``: the same as the ``megatron-gtpo`` command."""

from megatron_gtpo.cli import main

raise SystemExit(main())
