"""The bias diagnostics D1-D4 (docs/algorithms.md 6) of every algorithm on the same synthetic group:
Example 1 of docs/algorithms.md 5.9 (G = 4, rewards 1, 1, 0, 0, lengths 5, 5, 6, 5), each algorithm at
its own defaults (``algo.DEFAULTS``; GTPO with that example's <H>, threshold 0.7, gamma 0.1, code
normalisation; Dr. GRPO's L = 6; no KL term: no reference model here). The table of docs/algorithms.md
15 is this script's output, and tests/unit/test_algo_gspo_cispo.py checks that it still is.

Columns (pure tensor functions of ``megatron_gtpo.algo``, no training):

* ``d1_wagg``: D1, ``W_agg = sum_i omega_i A_i`` on the prefix all four completions share (token 5);
* ``d2_loss``: D2, the loss at rho = 1, ``-(sum_i A_i Omega_i - gamma R)``; ``d2_cov``: its within-group
  covariance part ``Cov(A, Omega)``;
* ``d3_grad_scale``: D3, ``|grad(phi = 10)| / |grad(phi = 1)|`` of the loss at rho = 1 when every reward
  is multiplied by phi (1: Adam never sees phi; 10: invariant only while Adam's eps is negligible);
* ``d4_zero_grad``: D4's premise, the share of tokens whose gradient the clip sets to 0 at a fixed
  pi / pi_old (``log rho_{i,t} = 0.25 sin(1 + 5 i + t)``, inside +-0.25), each at its own clip range.

    python bench/bias_table.py          # one markdown row per algorithm, then one JSON line
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_gtpo import algo  # noqa: E402
from megatron_gtpo.algo import AlgoConfig, TokenInputs  # noqa: E402

EXAMPLE1 = [[5, 7, 9, 11, 2], [5, 7, 8, 11, 2], [5, 7, 4, 12, 13, 2], [5, 6, 10, 11, 2]]
REWARDS = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
ENTROPY = torch.tensor([0.35, 0.50, 0.90, 0.40], dtype=torch.float64)
COLUMNS = ("d1_wagg", "d2_loss", "d2_cov", "d3_grad_scale", "d4_zero_grad")


def example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, mask [4, 6] and group ids of Example 1."""
    ids = torch.zeros(4, 6, dtype=torch.long)
    mask = torch.zeros(4, 6, dtype=torch.bool)
    for i, row in enumerate(EXAMPLE1):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = True
    return ids, mask, torch.zeros(4, dtype=torch.long)


def row(name: str) -> dict[str, float]:
    """The five columns of one algorithm (module docstring)."""
    ids, mask, gids = example()
    spec = AlgoConfig(name=name, kl_beta=0.0).resolve(max_completion_tokens=6)

    def prepared(phi: float):
        return algo.prepare_batch(spec, token_ids=ids, mask=mask, rewards=phi * REWARDS, group_ids=gids,
                                  mean_entropy=ENTROPY)

    prep = prepared(1.0)
    omega = algo.token_omega(spec, mask, prep)
    coeff = omega * prep.advantages.double()[:, None]
    d1 = algo.prefix_bias(ids, mask, gids, prep.raw_advantages, coeff, runs=prep.runs)
    d2 = algo.surrogate_decomposition(omega, prep, gids)

    def grad(phi: float) -> torch.Tensor:
        logp = torch.full(mask.shape, -1.0, dtype=torch.float64, requires_grad=True)
        loss, _ = algo.compute_loss(spec, TokenInputs(logp=logp, mask=mask), prepared(phi))
        loss.backward()
        return logp.grad

    i, t = torch.meshgrid(torch.arange(4.0), torch.arange(6.0), indexing="ij")
    log_ratio = torch.where(mask, 0.25 * torch.sin(1 + 5 * i + t), 0.0).double()
    old = torch.zeros(mask.shape, dtype=torch.float64)
    tokens = TokenInputs(logp=log_ratio, mask=mask, old_logp=old)
    zero_grad = algo.favoured_clip_mask(spec, algo.surrogate_log_ratio(spec, tokens), prep, mask)
    return {"d1_wagg": float(d1["bias/prefix_wagg_common"]), "d2_loss": float(d2.predicted_loss),
            "d2_cov": float(d2.cov_within), "d3_grad_scale": float(grad(10.0).norm() / grad(1.0).norm()),
            "d4_zero_grad": float(zero_grad.sum().double() / mask.sum().double())}


def markdown(name: str, values: dict[str, float]) -> str:
    """One table row, values to 4 significant digits (``-0`` printed as ``0``)."""
    cells = [f"{v:.4g}" if abs(v) > 1e-12 else "0" for v in (values[c] for c in COLUMNS)]
    return f"| {name} | " + " | ".join(cells) + " |"


def main() -> None:
    rows = {name: row(name) for name in algo.ALGO_NAMES}
    for name, values in rows.items():
        assert all(math.isfinite(v) for v in values.values()), (name, values)
        print(markdown(name, values))
    print(json.dumps({"bench": "bias_table", "rows": rows}))


if __name__ == "__main__":
    main()
