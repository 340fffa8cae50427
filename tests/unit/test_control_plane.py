"""parallel.control in a single process (the identity everywhere) and the parallel.timeout_s field.
The multi-rank behaviour and strict mode are in tests/dist/test_strict_groups.py."""

from __future__ import annotations

import pytest

from megatron_gtpo.config import load_config
from megatron_gtpo.parallel import control
from megatron_gtpo.parallel.dims import ParallelConfig
from megatron_gtpo.utils.configuration import ConfigError
from tests.helpers import REPO


def test_single_process_is_the_identity():
    obj = {"a": [1, 2]}
    assert control.broadcast_data(obj, src=0) is obj
    assert control.all_gather_data(obj) == [obj]
    assert control.reduce_floats([1, -2.5], "min") == [1.0, -2.5]
    assert control.any_rank(True) is True and control.any_rank(False) is False
    control.barrier()
    with pytest.raises(ValueError, match="op='avg' must be one of"):
        control.reduce_floats([1.0], "avg")


def test_timeout_field():
    assert ParallelConfig().timeout_s == 1800
    cfg = load_config(REPO / "configs" / "gtpo.yaml", ["parallel.timeout_s=90"])
    assert cfg.parallel.timeout_s == 90
    with pytest.raises(ConfigError, match="parallel.timeout_s=0.0 is not allowed"):
        load_config(REPO / "configs" / "gtpo.yaml", ["parallel.timeout_s=0"])
