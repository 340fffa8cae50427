"""Prompt datasets: Examples -> templated, tokenised, length-filtered Prompts with a resumable cursor.

    DataConfig --sources--> list[Example] --templates + chat template--> list[Prompt]
               --drop prompts over max_prompt_tokens (counted)--> PromptDataset
    PromptDataset.next_batch(n): walks a seeded permutation, reshuffled each epoch
    state_dict() / load_state_dict(): (epoch, position) plus a fingerprint of the prompt set

The order of epoch ``e`` depends only on (seed, e), so a resumed run draws exactly the prompts the
interrupted run would have drawn.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from tqdm import tqdm

from megatron_gtpo.data.config import DataConfig
from megatron_gtpo.data.sources import Example, load_benchmark, read_examples, read_hf_dataset
from megatron_gtpo.data.templates import build_messages, render_text, tokenize_texts
from megatron_gtpo.types import Prompt

_TOKENIZE_BATCH = 512


@dataclass(kw_only=True)
class DatasetStats:
    """Counts from building a prompt set: log ``summary()`` once at start-up and ``metrics()`` once
    to the tracker (prompts dropped for length are otherwise invisible)."""

    num_rows: int
    """Rows read from all sources."""
    num_prompts: int
    """Prompts kept."""
    num_too_long: int
    """Prompts dropped for exceeding max_prompt_tokens."""
    longest_tokens: int = 0
    """Token count of the longest prompt read, kept or dropped (0 for an empty set)."""
    max_prompt_tokens: int | None = None
    """The length limit applied (None: none)."""

    def summary(self) -> str:
        """One log line: rows, prompts kept, prompts dropped for length and the longest prompt."""
        limit = f" > data.max_prompt_tokens={self.max_prompt_tokens}" if self.max_prompt_tokens is not None else ""
        return (f"prompts: {self.num_prompts} of {self.num_rows} rows kept, {self.num_too_long} dropped as too long"
                f"{limit} (longest prompt {self.longest_tokens} tokens)")

    def metrics(self) -> dict[str, float]:
        """Flat metric names -> values for the tracker (log once, at the first step)."""
        return {"data/prompts": float(self.num_prompts), "data/prompts_dropped_too_long": float(self.num_too_long)}


def build_prompts(examples: list[Example], *, tokenizer, template: str, system_prompt: str = "",
                  use_chat_template: bool = True, max_prompt_tokens: int | None = None,
                  progress: bool = False) -> tuple[list[Prompt], DatasetStats]:
    """Templates and tokenises ``examples``; drops (and counts) prompts over ``max_prompt_tokens``."""
    texts = [render_text(build_messages(e, template=template, system_prompt=system_prompt),
                         tokenizer=tokenizer, use_chat_template=use_chat_template) for e in examples]
    token_ids: list[list[int]] = []
    for start in tqdm(range(0, len(texts), _TOKENIZE_BATCH), desc="tokenizing prompts", unit="batch",
                      disable=not progress, leave=False):
        token_ids += tokenize_texts(texts[start:start + _TOKENIZE_BATCH], tokenizer=tokenizer,
                                    use_chat_template=use_chat_template)
    prompts = [Prompt(uid=e.uid, token_ids=ids, text=text, gold=e.gold, task=e.task, row=e.row)
               for e, text, ids in zip(examples, texts, token_ids)
               if max_prompt_tokens is None or len(ids) <= max_prompt_tokens]
    return prompts, DatasetStats(num_rows=len(examples), num_prompts=len(prompts),
                                 num_too_long=len(examples) - len(prompts),
                                 longest_tokens=max(map(len, token_ids), default=0),
                                 max_prompt_tokens=max_prompt_tokens)


def load_examples(config: DataConfig) -> list[Example]:
    """All Examples named by ``config`` (benchmarks, then user files, then ``datasets`` sources, each in
    file order)."""
    examples: list[Example] = []
    for name in config.benchmarks:
        examples += load_benchmark(name, data_root=config.data_root or None, limit=config.limit)
    for path in config.paths:
        examples += read_examples(path, fields=config.fields, task=config.task, limit=config.limit)
    for spec in config.hf_datasets:
        examples += read_hf_dataset(spec, split=config.hf_split, fields=config.fields, task=config.task,
                                    limit=config.limit)
    return examples


class PromptDataset:
    """An endless, seeded stream of prompts with a resumable cursor.

    ``next_batch(n)`` returns the next ``n`` prompts of the current epoch's permutation and rolls
    over into the next epoch (a new permutation) when the epoch runs out, so a batch can straddle
    two epochs. With ``shuffle=False`` every epoch is the file order.
    """

    def __init__(self, prompts: list[Prompt], *, seed: int = 0, shuffle: bool = True,
                 stats: DatasetStats | None = None):
        if not prompts:
            raise ValueError("the prompt set is empty (no rows, or every prompt exceeded max_prompt_tokens); "
                             "check data.benchmarks / data.paths and raise data.max_prompt_tokens")
        self.prompts = prompts
        self.seed, self.shuffle = seed, shuffle
        self.stats = stats or DatasetStats(num_rows=len(prompts), num_prompts=len(prompts), num_too_long=0)
        digest = hashlib.sha256()
        for prompt in prompts:  # ids and rendered text: a template change is a different prompt set
            digest.update(f"{prompt.uid}\0{prompt.text}\0".encode())
        self.fingerprint = digest.hexdigest()[:16]
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def __len__(self) -> int:
        return len(self.prompts)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            # A string seed hashes the same on every platform and Python build (unlike hash()).
            random.Random(f"megatron-gtpo:{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts (``n`` >= 1; may exceed the dataset size)."""
        if n < 1:
            raise ValueError(f"next_batch(n={n}): n must be >= 1")
        batch = []
        while len(batch) < n:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(n - len(batch), len(self._order) - self.position)
            batch += [self.prompts[i] for i in self._order[self.position:self.position + take]]
            self.position += take
        return batch

    def state_dict(self) -> dict:
        """The cursor, as plain data for a checkpoint."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "shuffle": self.shuffle,
                "num_prompts": len(self.prompts), "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        """Restores a cursor saved by ``state_dict``; raises ValueError when it belongs to another
        prompt set or ordering (different data, filter, seed or shuffle flag)."""
        mine = self.state_dict()
        for key in ("fingerprint", "num_prompts", "seed", "shuffle"):
            if state.get(key) != mine[key]:
                raise ValueError(f"data cursor mismatch on {key!r}: checkpoint has {state.get(key)!r}, this run "
                                 f"has {mine[key]!r}; resume with the same data config (sources, template, "
                                 f"max_prompt_tokens, limit, seed, shuffle) or start fresh")
        position = int(state["position"])
        if not 0 <= position <= len(self.prompts):
            raise ValueError(f"data cursor position {position} is outside 0..{len(self.prompts)}")
        self.epoch, self.position = int(state["epoch"]), position
        self._order = self._permutation(self.epoch)


def build_dataset(config: DataConfig, *, tokenizer, progress: bool = True) -> PromptDataset:
    """The training prompt stream described by ``config``."""
    prompts, stats = build_prompts(load_examples(config), tokenizer=tokenizer, template=config.template,
                                   system_prompt=config.system_prompt,
                                   use_chat_template=config.use_chat_template,
                                   max_prompt_tokens=config.max_prompt_tokens, progress=progress)
    return PromptDataset(prompts, seed=config.seed, shuffle=config.shuffle, stats=stats)
