"""GTPO conflict tokens (spec 5.3-5.4, 5.9 examples 1-2, invariant 6) against hand tables and a loop reference."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_gtpo.algo import conflict, conflict_runs, conflict_weights

# Spec 5.9, example 1 (EOS = 2) and example 2 (o3, o4 changed so that o1's runs overlap).
EXAMPLE1 = [[5, 7, 9, 11, 2], [5, 7, 8, 11, 2], [5, 7, 4, 12, 13, 2], [5, 6, 10, 11, 2]]
EXAMPLE2 = [[5, 7, 9, 11, 2], [5, 7, 8, 11, 2], [5, 7, 9, 12, 13, 2], [5, 6, 9, 11, 2]]
EXAMPLE_ADV = [0.5, 0.5, -0.5, -0.5]


def padded(rows: list[list[int]], width: int | None = None, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids [B, T] and mask [B, T] from ragged rows."""
    width = width or max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row)] = True
    return ids, mask


def ragged(lam: torch.Tensor, rows: list[list[int]]) -> list[list[float]]:
    return [lam[i, :len(r)].tolist() for i, r in enumerate(rows)]


def loop_reference(ids, lens, adv, gid, *, weight, overlap, pad_id):
    """Obviously-correct transcription of spec 5.3-5.4: per completion, per direction, per position."""
    def at(j, d, backward):
        if d >= lens[j]:
            return None
        return ids[j][lens[j] - 1 - d if backward else d]

    fwd, bwd, lam = [], [], []
    for i in range(len(ids)):
        pos = [j for j in range(len(ids)) if gid[j] == gid[i] and adv[j] > 0]
        neg = [j for j in range(len(ids)) if gid[j] == gid[i] and adv[j] < 0]
        run = {}
        for backward in (False, True):
            raw = []
            for d in range(lens[i]):
                x = at(i, d, backward)
                raw.append(adv[i] != 0 and x != pad_id and any(at(j, d, backward) == x for j in pos)
                           and any(at(j, d, backward) == x for j in neg))
            run[backward] = next((d for d, r in enumerate(raw) if not r), len(raw))
        fwd.append(run[False])
        bwd.append(run[True])
        row = []
        for t in range(len(ids[i])):
            f, b = t < run[False], lens[i] - run[True] <= t < lens[i]
            w = weight if adv[i] > 0 else 0.0
            if adv[i] == 0 or not (f or b):
                row.append(1.0)
            elif overlap == "product":
                row.append((w if f else 1.0) * (w if b else 1.0))
            else:
                row.append(w)
        lam.append(row)
    return fwd, bwd, lam


def test_example1_lambda_table_and_runs():
    ids, mask = padded(EXAMPLE1)
    lam, runs = conflict_weights(ids, mask, torch.tensor(EXAMPLE_ADV), torch.zeros(4, dtype=torch.long),
                                 return_runs=True)
    assert ragged(lam, EXAMPLE1) == [[2, 2, 1, 2, 2], [2, 2, 1, 2, 2], [0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0]]
    assert runs.fwd.tolist() == [2, 2, 2, 1]      # o4's 6 at t = 1 ends its forward run
    assert runs.bwd.tolist() == [2, 2, 1, 2]      # o3 has 13 at distance 1
    assert runs.n.tolist() == [2, 2, 2, 2]        # the spec's n = [2, 2, 2, 2]
    assert runs.num_conflict_tokens.tolist() == [4, 4, 3, 3]
    assert lam.dtype == torch.float32


def test_example2_overlapping_runs_product_and_union():
    ids, mask = padded(EXAMPLE2)
    adv, gid = torch.tensor(EXAMPLE_ADV), torch.zeros(4, dtype=torch.long)
    lam, runs = conflict_weights(ids, mask, adv, gid, return_runs=True)
    assert ragged(lam, EXAMPLE2)[0] == [2, 2, 4, 4, 4]
    assert runs.fwd[0] == 5 and runs.bwd[0] == 3 and runs.n[0] == 5
    union = conflict_weights(ids, mask, adv, gid, overlap="union")
    assert ragged(union, EXAMPLE2)[0] == [2, 2, 2, 2, 2]
    # a negative completion's conflicts are 0 in both modes
    assert torch.equal(lam[2:], union[2:])


def test_weight_and_inactive_and_padding_positions():
    ids, mask = padded(EXAMPLE1, width=8)
    adv = torch.tensor([0.5, 0.0, -0.5, 0.0])
    lam = conflict_weights(ids, mask, adv, torch.zeros(4, dtype=torch.long), weight=3.0)
    assert torch.all(lam[1] == 1) and torch.all(lam[3] == 1)          # inactive: 1 everywhere
    assert torch.all(lam[:, 6:] == 1)                                  # outside the mask: neutral 1
    assert ragged(lam, EXAMPLE1)[0] == [3, 3, 1, 1, 3]                 # only o3 is negative now
    assert ragged(lam, EXAMPLE1)[2] == [0, 0, 1, 1, 1, 0]


def test_groups_do_not_interact_and_ids_are_labels():
    ids, mask = padded(EXAMPLE1 + EXAMPLE1)
    adv = torch.tensor(EXAMPLE_ADV + [0.5, -0.5, 0.5, -0.5])
    gid = torch.tensor([7, 7, 7, 7, -3, -3, -3, -3])
    lam = conflict_weights(ids, mask, adv, gid)
    alone = conflict_weights(*padded(EXAMPLE1), torch.tensor(EXAMPLE_ADV), torch.zeros(4, dtype=torch.long))
    assert torch.equal(lam[:4, :6], alone)
    expected = loop_reference(EXAMPLE1, [5, 5, 6, 5], [0.5, -0.5, 0.5, -0.5], [0] * 4,
                              weight=2.0, overlap="product", pad_id=None)[2]
    assert ragged(lam[4:], EXAMPLE1) == expected


def test_pad_id_breaks_runs():
    rows = [[5, 9, 7, 2], [5, 9, 7, 2], [5, 9, 8, 2]]
    ids, mask = padded(rows)
    adv, gid = torch.tensor([1.0, 1.0, -2.0]), torch.zeros(3, dtype=torch.long)
    assert conflict_runs(ids, mask, adv, gid).fwd.tolist() == [2, 2, 2]
    assert conflict_runs(ids, mask, adv, gid, pad_id=9).fwd.tolist() == [1, 1, 1]


@st.composite
def random_batches(draw):
    width = draw(st.integers(1, 9))
    vocab = draw(st.integers(1, 3))
    rows, lens, adv, gid = [], [], [], []
    for g in range(draw(st.integers(1, 4))):
        for _ in range(draw(st.integers(1, 5))):
            length = draw(st.integers(0, width))
            lens.append(length)
            rows.append([draw(st.integers(0, vocab)) for _ in range(length)] + [0] * (width - length))
            adv.append(draw(st.sampled_from([-1.5, -0.25, 0.0, 0.0, 0.5, 2.0])))
            gid.append(100 - 7 * g)
    order = draw(st.permutations(range(len(rows))))
    pick = lambda xs: [xs[k] for k in order]  # noqa: E731  (groups interleave in the batch)
    return pick(rows), pick(lens), pick(adv), pick(gid)


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(batch=random_batches(), overlap=st.sampled_from(["product", "union"]),
       pad_id=st.sampled_from([None, 0, 1]), first_window=st.sampled_from([1, 2, 3, 64]),
       weight=st.sampled_from([2.0, 1.5]), kernel=st.sampled_from(["auto", "slots", "keys"]))
def test_vectorised_matches_loop_reference(batch, overlap, pad_id, first_window, weight, kernel):
    with mock.patch.object(conflict, "_MAX_SLOT_PADDING", {"auto": 2.0, "slots": float("inf"), "keys": -1.0}[kernel]):
        check_against_loop(batch, overlap, pad_id, first_window, weight)


def check_against_loop(batch, overlap, pad_id, first_window, weight):
    rows, lens, adv, gid = batch
    ids = torch.tensor(rows, dtype=torch.long)
    mask = torch.arange(ids.shape[1])[None, :] < torch.tensor(lens)[:, None]
    a, g = torch.tensor(adv), torch.tensor(gid)
    fwd, bwd, lam = loop_reference(rows, lens, adv, gid, weight=weight, overlap=overlap, pad_id=pad_id)
    runs = conflict_runs(ids, mask, a, g, pad_id=pad_id, first_window=first_window)
    assert runs.fwd.tolist() == fwd and runs.bwd.tolist() == bwd
    got = conflict_weights(ids, mask, a, g, weight=weight, overlap=overlap, pad_id=pad_id)
    assert got.tolist() == lam


@pytest.mark.parametrize("padding", [float("inf"), -1.0])
def test_long_runs_cross_many_windows(padding, monkeypatch):
    monkeypatch.setattr(conflict, "_MAX_SLOT_PADDING", padding)
    # identical positive/negative pairs: every run spans the whole completion (the worst case)
    base = torch.randint(3, 50, (1, 300), generator=torch.Generator().manual_seed(0))
    ids = base.repeat(4, 1)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[3, 250:] = False
    runs = conflict_runs(ids, mask, torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.zeros(4, dtype=torch.long),
                         first_window=4)
    assert runs.fwd.tolist() == [300, 300, 300, 250]
    # backward runs of the 300-token rows are supported by the other two full rows
    assert runs.bwd.tolist()[:3] == [300, 300, 300]


@pytest.mark.parametrize("case, match", [
    ("mask_not_prefix", "mask row 1 is not a prefix of ones"),
    ("mask_values", "mask must hold only 0 and 1"),
    ("ids_shape", "token_ids has shape"),
    ("ids_float", "token_ids must have an integer dtype"),
    ("adv_nan", "advantages holds a non-finite value"),
    ("adv_shape", "advantages has shape"),
    ("groups_shape", "group_ids has shape"),
    ("overlap", "overlap='max' must be one of"),
    ("weight", "weight=0.0 must be a finite number > 0"),
    ("negative_id", "token_ids must be >= 0"),
])
def test_bad_input_names_the_argument(case, match):
    ids, mask = padded(EXAMPLE1)
    kwargs = dict(token_ids=ids, mask=mask, advantages=torch.tensor(EXAMPLE_ADV),
                  group_ids=torch.zeros(4, dtype=torch.long))
    extra = {}
    if case == "mask_not_prefix":
        kwargs["mask"] = mask.clone()
        kwargs["mask"][1, 2] = False
    elif case == "mask_values":
        kwargs["mask"] = mask.long() * 2
    elif case == "ids_shape":
        kwargs["token_ids"] = ids[:, :3]
    elif case == "ids_float":
        kwargs["token_ids"] = ids.float()
    elif case == "adv_nan":
        kwargs["advantages"] = torch.tensor([0.5, float("nan"), -0.5, -0.5])
    elif case == "adv_shape":
        kwargs["advantages"] = torch.tensor(EXAMPLE_ADV[:3])
    elif case == "groups_shape":
        kwargs["group_ids"] = torch.zeros(5, dtype=torch.long)
    elif case == "overlap":
        extra["overlap"] = "max"
    elif case == "weight":
        extra["weight"] = 0.0
    elif case == "negative_id":
        kwargs["token_ids"] = ids.clone()
        kwargs["token_ids"][0, 0] = -100
        assert conflict_weights(ids.masked_fill(~mask, -100), mask, kwargs["advantages"],
                                kwargs["group_ids"]).tolist() == conflict_weights(ids, mask, kwargs["advantages"],
                                                                                  kwargs["group_ids"]).tolist()
    with pytest.raises(ValueError, match=match):
        conflict_weights(**kwargs, **extra)
