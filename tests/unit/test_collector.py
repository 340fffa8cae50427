"""RolloutCollector (rollout/collector.py) with a scripted engine and the real reward scorer:
grouping, DAPO's refill loop, the try budget, the divisibility cut and the per-step seeds."""

from __future__ import annotations

from types import SimpleNamespace

from megatron_gtpo.data.dataset import PromptDataset
from megatron_gtpo.reward import RewardConfig, RewardOutput, RewardScorer
from megatron_gtpo.rollout.collector import DynamicSampling, OffPolicy, RolloutCollector, rollout_metrics
from megatron_gtpo.rollout.config import Sampling
from megatron_gtpo.types import Completion, Prompt


class ScriptedEngines:
    """Stands in for RolloutGroup.generate/submit: prompt ``p<k>`` gets completions whose text is read
    from SCRIPT[k] (one string per sample), tagged with the weight version ``version`` the engines
    serve; records the seeds it was called with."""

    def __init__(self, script: dict[int, list[str]]):
        self.script, self.seeds, self.version = script, [], 0

    def submit(self, prompts, sampling, *, seed):
        done = self.generate(prompts, sampling, seed=seed)  # like engines in the trainer processes: generated now
        return SimpleNamespace(wait=lambda: done)

    def generate(self, prompts, sampling, *, seed):
        n = sampling.n
        self.seeds.append(seed)
        out = []
        for i, prompt in enumerate(prompts):
            texts = self.script[int(prompt.uid[1:])]
            out += [Completion(prompt_index=i, prompt_token_ids=prompt.token_ids, token_ids=[7] * len(t),
                               logprobs=[-1.0] * len(t), text=t, weight_version=self.version) for t in texts[:n]]
        return out


def collector(script, *, dynamic=None, group_multiple=1, off_policy=None):
    prompts = [Prompt(uid=f"p{k}", token_ids=[1, 2, k + 3], gold="", task="gsm8k") for k in range(len(script))]
    dataset = PromptDataset(prompts, shuffle=False)
    scorer = RewardScorer(RewardConfig(fn="tests.unit.test_collector.letter_a_reward", num_workers=0))
    engines = ScriptedEngines(script)
    sampling = Sampling(n=2, temperature=1.0, top_p=1.0, max_tokens=8)
    return RolloutCollector(engines, dataset, scorer, sampling=sampling, seed=5, dynamic=dynamic,
                            group_multiple=group_multiple, off_policy=off_policy or OffPolicy()), engines


def letter_a_reward(completion, gold, task):
    """1 (correct) for a completion containing 'a', else 0."""
    return RewardOutput(reward=float("a" in completion), correct="a" in completion)


def test_groups_follow_prompts_and_metrics():
    c, engines = collector({0: ["a", "b"], 1: ["bb", "ab"]})
    batch = c.collect(1, prompts_per_step=2)
    assert [g.prompt.uid for g in batch.groups] == ["p0", "p1"]
    assert [g.rewards for g in batch.groups] == [[1.0, 0.0], [0.0, 1.0]]
    m = rollout_metrics(batch)
    assert (m["reward/mean"], m["rollout/tries"], m["rollout/groups"], m["reward/num_samples"]) == (0.5, 1.0, 2.0, 4.0)
    c.collect(2, prompts_per_step=2)
    assert engines.seeds == [5 * 1_000_003 + 1, 5 * 1_000_003 + 1_009 + 1]  # derived from the step: resumable


def test_dynamic_sampling_drops_all_equal_groups_and_refills():
    script = {0: ["a", "a"], 1: ["b", "ab"], 2: ["b", "b"], 3: ["a", "b"], 4: ["a", "b"]}
    c, engines = collector(script, dynamic=DynamicSampling(metric="accuracy", max_tries=5))
    batch = c.collect(1, prompts_per_step=2)
    # try 1: p0 (all right) and p1 (mixed) -> keep p1; try 2: p2 (all wrong) -> dropped; try 3: p3 kept
    assert [g.prompt.uid for g in batch.groups] == ["p1", "p3"]
    assert (batch.tries, batch.dropped_groups) == (3, 2)
    assert len(engines.seeds) == 3 and len(set(engines.seeds)) == 3


def test_dynamic_sampling_stops_at_its_try_budget_and_cuts_to_the_batch_unit():
    script = {0: ["a", "a"], 1: ["b", "ab"], 2: ["b", "b"], 3: ["a", "a"]}
    c, _ = collector(script, dynamic=DynamicSampling(metric="accuracy", max_tries=2), group_multiple=2)
    batch = c.collect(1, prompts_per_step=2)
    # two tries keep only p1; one group is not a multiple of 2 groups: the step trains on nothing
    assert batch.groups == [] and batch.tries == 2 and batch.dropped_groups == 3
    assert rollout_metrics(batch) == {"rollout/groups": 0.0, "rollout/tries": 2.0, "rollout/dropped_groups": 3.0}
