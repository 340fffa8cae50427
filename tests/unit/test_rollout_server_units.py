"""Engine-free parts of the rollout server and the pool push: the per-server staging volume and layout
(sync/staging.py), one send per bucket per server (sync/separate.py), the generate codec
(rollout/messages.py, the Sampling record as data), and what ``megatron-gtpo rollout-server`` builds from a recipe (the fp32 head,
the address it listens on). Real servers: tests/e2e/test_rollout_server.py, test_security_rollout_server.py."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_gtpo.cli import rollout_server as cli
from megatron_gtpo.rollout import messages as msg
from megatron_gtpo.rollout.config import Sampling
from megatron_gtpo.sync.base import WeightSync
from megatron_gtpo.sync.separate import PoolSync
from megatron_gtpo.sync.shards import plan_buckets, push_bytes
from megatron_gtpo.sync.staging import SharedArea, layout, map_area, staging_bytes
from megatron_gtpo.sync.wire import receive_args
from megatron_gtpo.types import Completion, Prompt
from megatron_gtpo.utils.channel import SchemaError, check
from tests.helpers import REPO
from tests.unit.test_sync_shards import QWEN2, SHAPES, entries


def push_plan():
    plan = plan_buckets(entries(tp=2, pp=2), family=QWEN2, shapes=SHAPES, tp=2, bucket_bytes=64 << 10)
    return plan, [m for b in plan for m in b.tensors]


def test_pool_staging_per_server_is_one_copy_of_the_push():
    plan, metas = push_plan()
    staged = layout(metas, receive_args(1, plan)["buckets"])
    total = staging_bytes(b.nbytes for b in plan)
    assert sum(b.nbytes for b in staged) == total and staged[-1].start + staged[-1].nbytes == total
    # one copy: the payload plus at most 64 bytes of packing per tensor, whatever the engine TP
    assert push_bytes(metas) <= total <= push_bytes(metas) + 64 * len(metas)
    assert [m for b in staged for m in b.tensors] == metas and all(b.start % 64 == 0 for b in staged)


@pytest.mark.parametrize("change, match", [
    (lambda b: b[0].update(nbytes=b[0]["nbytes"] + 64), "pack into"),  # asks for more staging than it holds
    (lambda b: b.pop(), "hold"),  # fewer tensors than the checked plan
    (lambda b: b[0].update(tensors=b[0]["tensors"] + 1000), "are left"),  # more than the plan has
    (lambda b: b[0].update(tensors=0), "names 0 tensors"),
])
def test_pool_staging_layout_stages_exactly_the_checked_plan(change, match):
    plan, metas = push_plan()
    buckets = receive_args(1, plan)["buckets"]
    change(buckets)
    with pytest.raises(ValueError, match=match):
        layout(metas, buckets)


def test_pool_staging_area_is_one_shared_mapping():
    area = SharedArea(4096, generation=1)
    try:
        writer, reader = map_area(area.path, area.nbytes), map_area(area.path, area.nbytes)
        writer[100:104] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        assert reader[100:104].tolist() == [1, 2, 3, 4]  # what worker 0 receives, every worker sees
        assert area.path.startswith("/proc/")  # no name in any file system
    finally:
        area.close()


def test_security_a_bucket_corrupted_in_flight_is_refused_and_the_engine_keeps_its_version():
    """The server checks every staged bucket against the digest its sender sent over the authenticated
    channel before a commit may load it; a byte changed on the way (the transfer group is not
    authenticated) drops the push and the engine keeps serving its version (injected: ``_on_verify``
    comparing nothing -> the corrupted push verifies and commits, the test fails)."""
    from megatron_gtpo.errors import WeightPushError
    from megatron_gtpo.sync.receiver import PushReceiver
    from megatron_gtpo.sync.staging import StagedBucket
    from megatron_gtpo.sync.wire import bucket_digest

    rpcs: list[str] = []
    engine = SimpleNamespace(weight_version=3, rpc=lambda name, **kw: rpcs.append(name),
                             loaded=lambda version, ok: rpcs.append(f"loaded v{version}"))
    receiver = PushReceiver()
    receiver.ctx = SimpleNamespace(engine=engine)
    sent = [bytes(range(64)), bytes(range(64, 192))]
    buckets = [StagedBucket(owner=0, start=0, nbytes=64, tensors=()), StagedBucket(owner=0, start=64, nbytes=128,
                                                                                    tensors=())]
    receiver._area = SharedArea(192, generation=1)
    try:
        staged = map_area(receiver._area.path, 192)
        for arrived in (b"".join(sent), b"".join(sent)[:100] + b"\xff" + b"".join(sent)[101:]):
            staged[:] = torch.frombuffer(bytearray(arrived), dtype=torch.uint8)
            receiver.session, receiver._staged, receiver._verified = True, (4, buckets), None
            digests = {"version": 4, "digests": [bucket_digest(torch.frombuffer(bytearray(b), dtype=torch.uint8))
                                                 for b in sent]}
            if arrived == b"".join(sent):
                assert receiver._on_verify(digests, []) == {"buckets": 2}
                continue
            with pytest.raises(WeightPushError, match=r"buckets \[1\] arrived corrupted.*still serving v3"):
                receiver._on_verify(digests, [])
            assert rpcs[-2:] == ["mgtpo_discard_staged", "finish_weight_update"]  # dropped, nothing loaded
            with pytest.raises(WeightPushError, match="without a complete transfer"):
                receiver._on_commit({"version": 4}, [])
            receiver.session = True  # even with an open update, an unverified push never commits
            with pytest.raises(WeightPushError, match="before its digests were verified"):
                receiver._on_commit({"version": 4}, [])
        assert not any(r.startswith("loaded") for r in rpcs)
    finally:
        receiver._area.close()


class RecordingGroup:
    def __init__(self):
        self.sends = []

    def send(self, tensors, dst, tag):
        self.sends.append((dst, tensors[0].numel()))
        return SimpleNamespace(wait=lambda: None)


def test_pool_sender_sends_each_bucket_once_per_server_whatever_its_engine_tp():
    sync = PoolSync.__new__(PoolSync)
    WeightSync.__init__(sync, SimpleNamespace(dims=SimpleNamespace(pp=2), bucket_bytes=1 << 20))
    sync.servers = [("a:1", {"tp": 8}), ("b:1", {"tp": 4})]
    sync._groups, sync.sent_bytes = [RecordingGroup(), RecordingGroup()], 0
    sync._send(torch.zeros(1000, dtype=torch.uint8), {})
    sync._send(torch.zeros(500, dtype=torch.uint8), {"b:1": "dead"})
    # to each server's worker 0 (group rank = number of senders = pp), one copy per bucket
    assert [g.sends for g in sync._groups] == [[(2, 1000), (2, 500)], [(2, 1000)]]
    assert sync.sent_bytes == 2500


def test_generate_codec_round_trip_sends_only_token_ids():
    prompts = [Prompt(uid="secret-uid", token_ids=[5, 6, 7], text="private text", gold="42"),
               Prompt(uid="b", token_ids=[9])]
    sampling = Sampling(n=2, temperature=1.0, top_p=0.9, max_tokens=4, stop=("\n\n",))
    args, blobs = msg.encode_generate(prompts, [11, 13], sampling)
    check(args, msg.GENERATE)
    assert "private text" not in repr(args) and "secret-uid" not in repr(args) and "42" not in repr(args)
    got, seeds, back = msg.decode_generate(args, blobs, LIMITS)
    assert [p.token_ids for p in got] == [[5, 6, 7], [9]] and seeds == [11, 13] and back == sampling
    completions = [Completion(prompt_index=i // 2, prompt_token_ids=got[i // 2].token_ids, token_ids=[i, 3],
                              logprobs=[-0.1 * i, -1e-300], text=f"t{i}", weight_version=4) for i in range(4)]
    result, out_blobs = msg.encode_completions(4, completions)
    check(result, msg.GENERATE_REPLY)
    version, decoded = msg.decode_completions(result, out_blobs, prompts)
    assert version == 4 and [c.logprobs for c in decoded] == [c.logprobs for c in completions]  # float64 exact
    assert decoded[3].prompt_token_ids is prompts[1].token_ids  # the trainer's own prompt
    with pytest.raises(SchemaError):
        msg.decode_generate({**args, "seeds": [1]}, blobs, LIMITS)
    with pytest.raises(SchemaError):
        msg.decode_generate(args, [bytes(blobs[0])[:-4]], LIMITS)


LIMITS = msg.GenerateLimits(max_model_len=64, vocab_size=100)


def test_security_generate_requests_are_capped_by_what_the_engine_can_serve():
    """Caps on a request an authenticated peer could use to exhaust the server's memory or reach past
    its vocabulary (injected: ``_check_limits`` not called -> every case decodes, the test fails)."""
    prompt = [Prompt(uid="a", token_ids=[1, 2])]
    ok = Sampling(n=2, temperature=1.0, max_tokens=64, stop=("x",) * 32)
    msg.decode_generate(*msg.encode_generate(prompt, [1], ok), LIMITS)  # at every limit: served
    for bad, match in [({"n": (1 << 16) + 1}, "completions"), ({"max_tokens": 65}, "max_model_len"),
                       ({"stop": ("x",) * 33}, "stop strings"), ({"stop": ("x" * 257,)}, "stop strings")]:
        args, blobs = msg.encode_generate(prompt, [1], dataclasses.replace(ok, **bad))
        with pytest.raises(SchemaError, match=match):
            msg.decode_generate(args, blobs, LIMITS)
    for tokens in ([1, 100], [-1, 2], [1] * 65):
        args, blobs = msg.encode_generate([Prompt(uid="a", token_ids=tokens)], [1], ok)
        with pytest.raises(SchemaError, match=r"lie in \[0, 100\)|max_model_len"):
            msg.decode_generate(args, blobs, LIMITS)


def test_rollout_server_from_a_recipe_samples_from_the_trainers_fp32_head(tmp_path, monkeypatch):
    monkeypatch.delenv("MGTPO_ROLLOUT_HOSTS", raising=False)
    monkeypatch.delenv("NET_IFNAME", raising=False)
    recipe = tmp_path / "recipe.yaml"
    base = REPO / "configs" / "tiny.yaml"
    recipe.write_text(f"base: {base}\nmodel:\n  lm_head_fp32: true\nrollout:\n  vllm:\n    hf_overrides: {{a: 1}}\n")
    args = argparse.Namespace(config=str(recipe), model_dir=None, host=None, port=None, timeout_s=None)
    spec = cli.spec_from_args(args)
    assert spec.vllm["hf_overrides"] == {"a": 1, "head_dtype": "float32"}  # the recipe's overrides kept
    assert spec.host == "127.0.0.1"  # loopback unless told otherwise, never all interfaces
    recipe.write_text(f"base: {base}\n")
    assert "hf_overrides" not in cli.spec_from_args(args).vllm  # off: the model's own head dtype


def test_engines_start_with_the_trainers_head_and_an_empty_load_for_megatron_checkpoints():
    """RolloutConfig.for_engines: the one rule trainer.build and the rollout-server CLI share."""
    from megatron_gtpo.rollout.config import RolloutConfig

    recipe = RolloutConfig(vllm={"hf_overrides": {"a": 1}, "dtype": "float32"})
    assert recipe.for_engines(lm_head_fp32=False, hf_weights=True).vllm == recipe.vllm  # nothing to change
    both = recipe.for_engines(lm_head_fp32=True, hf_weights=False).vllm
    assert both == {"hf_overrides": {"a": 1, "head_dtype": "float32"}, "dtype": "float32", "load_format": "dummy"}
    assert recipe.vllm == {"hf_overrides": {"a": 1}, "dtype": "float32"}  # the recipe itself is untouched
    own = RolloutConfig(vllm={"hf_overrides": {"head_dtype": "bfloat16"}, "load_format": "safetensors"})
    assert own.for_engines(lm_head_fp32=True, hf_weights=False).vllm == own.vllm  # the recipe's own choices win


def test_rollout_server_listens_on_its_own_address_among_the_rollout_hosts(monkeypatch):
    monkeypatch.setenv("MGTPO_ROLLOUT_HOSTS", "192.0.2.7,127.0.0.1")  # 192.0.2.7 (TEST-NET) is not this node
    assert cli.bind_host(None) == "127.0.0.1"
    assert cli.bind_host("10.1.2.3") == "10.1.2.3"
    monkeypatch.setenv("MGTPO_ROLLOUT_HOSTS", "192.0.2.7")
    monkeypatch.setenv("NET_IFNAME", "lo")
    assert cli.bind_host(None) == "127.0.0.1"  # the interface's IPv4 address


def test_sampling_crosses_the_wire_as_its_checked_fields():
    """The schema lists exactly the record's fields (a field added to Sampling must be added to the
    wire, or every generate is refused), and a value the record refuses is a malformed request."""
    assert set(msg.SAMPLING) == {f.name for f in dataclasses.fields(Sampling)}
    args, blobs = msg.encode_generate([Prompt(uid="a", token_ids=[1])], [3], Sampling(n=1, temperature=0.0,
                                                                                       max_tokens=2))
    assert args["sampling"] == {"n": 1, "temperature": 0.0, "top_p": 1.0, "max_tokens": 2, "stop": []}
    check(args, msg.GENERATE)
    for bad in ({"n": 0}, {"top_p": 1.5}, {"temperature": -1.0}):
        forged = {**args, "sampling": {**args["sampling"], **bad}}
        check(forged, msg.GENERATE)  # the types are right: the record's own checks refuse it
        with pytest.raises(SchemaError, match="Sampling"):
            msg.decode_generate(forged, blobs, LIMITS)
    with pytest.raises(SchemaError):
        check({**args, "sampling": {**args["sampling"], "logprobs": 5}}, msg.GENERATE)  # an unknown field


def assert_implements(cls, protocol) -> None:
    """Every method and property ``protocol`` (and the protocols it extends) declares exists on ``cls``
    as the same kind of member with the declared parameter names (a structural check: nobody asks an
    engine what it is)."""
    declared = {name: member for base in reversed(protocol.__mro__) if getattr(base, "_is_protocol", False)
                for name, member in vars(base).items()}
    assert declared, protocol
    for name, member in declared.items():
        if name.startswith("_") or not (callable(member) or isinstance(member, property)):
            continue
        mine = getattr(cls, name)
        assert isinstance(mine, property) == isinstance(member, property), (cls.__name__, name)
        if callable(member):
            want = [p for p in inspect.signature(member).parameters if p != "self"]
            assert [p for p in inspect.signature(mine).parameters if p != "self"] == want, (cls.__name__, name)


def test_the_pool_server_engine_and_receiver_implement_the_declared_protocols():
    from megatron_gtpo.rollout.engine import RolloutEngine
    from megatron_gtpo.rollout.pool import RolloutPool
    from megatron_gtpo.rollout.protocol import Engine, ServedEngine, ServerPool, WeightReceiver
    from megatron_gtpo.sync.receiver import PushReceiver

    assert_implements(RolloutPool, Engine)
    assert_implements(RolloutPool, ServerPool)
    assert_implements(RolloutEngine, ServedEngine)
    assert_implements(PushReceiver, WeightReceiver)
    assert isinstance(PushReceiver.vllm_kwargs, dict)
    pool = RolloutPool([], model_dir="unused", secret_path=REPO / "secret")
    assert pool.secret_path == REPO / "secret"  # an attribute of the protocol, not a method


def test_a_local_server_whose_engine_fails_is_reported_with_its_log_even_while_it_is_still_exiting():
    """The server holds its port before its engine loads; when the engine fails, the trainer's
    ``hello`` breaks while the process is still going down. Bug caught: deciding "alive" at that
    instant reported a bare connection reset (no log, no reason) in the e2e start-failure test."""
    import logging
    import os
    import time

    from megatron_gtpo.errors import ServerError
    from megatron_gtpo.rollout.pool import ServerLink
    from megatron_gtpo.utils.channel import Listener

    secret, dies_at = os.urandom(32), []

    def route(channel):  # admit the trainer, then "fail to load": drop the connection, exit 0.5 s later
        channel.send({"ok": True})
        channel.recv(timeout_s=10.0)
        dies_at.append(time.monotonic() + 0.5)
        channel.close()

    listener = Listener("127.0.0.1", 0, secret, route=route, log=logging.getLogger("test"))
    try:
        with pytest.raises(ServerError, match="exited before it was ready; the log tail"):
            ServerLink(f"127.0.0.1:{listener.address[1]}", secret=secret, timeout_s=5.0,
                       alive=lambda: not dies_at or time.monotonic() < dies_at[0], log_hint=lambda: "; the log tail")
    finally:
        listener.close()


def _spanning_completions(prompts) -> list[Completion]:
    """Four completions: two within one version, two across a push (``token_versions``)."""
    return [Completion(prompt_index=0, prompt_token_ids=prompts[0].token_ids, token_ids=[4, 5, 6], logprobs=[-1.0] * 3,
                       weight_version=2),
            Completion(prompt_index=0, prompt_token_ids=prompts[0].token_ids, token_ids=[7, 8, 9, 10],
                       logprobs=[-0.5] * 4, weight_version=2, token_versions=[2, 2, 3, 3]),
            Completion(prompt_index=1, prompt_token_ids=prompts[1].token_ids, token_ids=[], logprobs=[],
                       weight_version=3),
            Completion(prompt_index=1, prompt_token_ids=prompts[1].token_ids, token_ids=[1, 2], logprobs=[-2.0] * 2,
                       weight_version=1, token_versions=[1, 3])]


def test_completion_codec_carries_token_versions_in_a_third_blob():
    """Completions continued across a push keep each token's version over the wire; answers without
    any stay two blobs (an old trainer reads them as before)."""
    prompts = [Prompt(uid="a", token_ids=[1, 2]), Prompt(uid="b", token_ids=[3])]
    completions = _spanning_completions(prompts)
    result, blobs = msg.encode_completions(3, completions)
    check(result, msg.GENERATE_REPLY)
    assert len(blobs) == 3 and len(blobs[2]) == 4 * 9
    version, back = msg.decode_completions(result, blobs, prompts)
    assert version == 3
    assert [(c.token_ids, c.weight_version, c.token_versions) for c in back] == \
        [(c.token_ids, c.weight_version, c.token_versions) for c in completions]
    assert [c.versions() for c in back] == [[2, 2, 2], [2, 2, 3, 3], [], [1, 3]]
    plain = [c for c in completions if c.token_versions is None]
    result, blobs = msg.encode_completions(3, plain)
    assert len(blobs) == 2
    assert all(c.token_versions is None for c in msg.decode_completions(result, blobs, prompts)[1])


@pytest.mark.parametrize("forge, match", [
    (lambda v: v[:-1], "token versions"),                        # one version short
    (lambda v: v + [3], "token versions"),                       # one too many
    (lambda v: [2, 2, 2, 2, 3, 2, 2, 3, 3], "never decrease"),   # 3 then 2 within a completion
    (lambda v: [2, 2, 2, 3, 3, 3, 3, 1, 3], "start at"),         # the second starts at 3, row says 2
])
def test_security_malformed_token_versions_are_refused(forge, match):
    prompts = [Prompt(uid="a", token_ids=[1, 2]), Prompt(uid="b", token_ids=[3])]
    result, blobs = msg.encode_completions(3, _spanning_completions(prompts))
    versions = np.frombuffer(blobs[2], dtype="<i4").tolist()
    assert versions == [2, 2, 2, 2, 2, 3, 3, 1, 3]
    forged = np.asarray(forge(versions), dtype="<i4").tobytes()
    with pytest.raises(SchemaError, match=match):
        msg.decode_completions(result, blobs[:2] + [forged], prompts)
    with pytest.raises(SchemaError, match="blobs"):
        msg.decode_completions(result, blobs + [blobs[2]], prompts)


def test_submit_and_fetch_requests_are_checked():
    prompts = [Prompt(uid="a", token_ids=[5, 6]), Prompt(uid="b", token_ids=[7])]
    sampling = Sampling(n=2, temperature=1.0, max_tokens=8)
    args, blobs = msg.encode_submit(12, "continue", prompts, [3, 9], sampling)
    check(args, msg.SUBMIT)
    assert args["job"] == 12 and args["partial"] == "continue"
    got, seeds, back = msg.decode_submit(args, blobs, LIMITS)
    assert [p.token_ids for p in got] == [[5, 6], [7]] and seeds == [3, 9] and back == sampling
    for partial in msg.PARTIAL:
        msg.decode_submit({**args, "partial": partial}, blobs, LIMITS)
    with pytest.raises(SchemaError, match="partial"):
        msg.decode_submit({**args, "partial": "later"}, blobs, LIMITS)
    with pytest.raises(SchemaError, match="max_model_len"):  # generate's limits hold
        too_long = Sampling(n=1, temperature=1.0, max_tokens=65)
        msg.decode_submit(*msg.encode_submit(1, "off", prompts, [3, 9], too_long), LIMITS)
    for bad in ({**args, "job": "12"}, {**args, "partial": None}, {k: v for k, v in args.items() if k != "job"},
                {**args, "extra": 1}):
        with pytest.raises(SchemaError):
            check(bad, msg.SUBMIT)
    check({"job": 3}, msg.FETCH)
    for bad in ({}, {"job": 3.0}, {"job": 3, "wait": True}):
        with pytest.raises(SchemaError):
            check(bad, msg.FETCH)


def test_the_commit_reloads_inside_the_servers_swapping_block():
    """Background generation pauses around the reload (injected: the commit outside ``swapping()``
    -> the reload is recorded outside the block, the test fails)."""
    import contextlib

    from megatron_gtpo.sync.receiver import PushReceiver

    events: list[str] = []

    @contextlib.contextmanager
    def swapping():
        events.append("pause")
        yield
        events.append("resume")

    engine = SimpleNamespace(weight_version=3, rpc=lambda name, **kw: events.append(name),
                             loaded=lambda version, ok: events.append(f"loaded v{version} {ok}"))
    receiver = PushReceiver()
    receiver.ctx = SimpleNamespace(engine=engine, swapping=swapping)
    receiver.session, receiver._verified = True, 4
    assert receiver._on_commit({"version": 4}, []) == {"version": 4}
    assert events == ["pause", "finish_weight_update", "loaded v4 True", "resume"]
