"""Helpers shared by the test layers: launching gloo worlds and reading their results."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from megatron_gtpo.parallel.launch import free_port  # noqa: F401 -- the tests import it from here
from megatron_gtpo.parallel.strict import ENV as STRICT_ENV

REPO = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """Environment of a launched run: this checkout on the path and strict device groups on (a
    host tensor or object collective on a device group raises as NCCL would; parallel/strict.py)
    unless the caller's environment says otherwise."""
    return {**os.environ, "PYTHONPATH": str(REPO), STRICT_ENV: os.environ.get(STRICT_ENV, "1"), **extra}


def kill_tree(pid: int, sig: int = 9) -> None:
    """Sends ``sig`` (SIGKILL) to ``pid`` and every descendant at once, as a crash or outage would.

    ``os.killpg`` on the launcher's group is not enough: torchrun starts each rank in a new
    session (its own process group), so the ranks would survive the kill and keep training.
    The tree is frozen (SIGSTOP) before the first SIGKILL: killed one by one, a rank that outlived
    its peer by a few milliseconds on a loaded machine saw the closed socket and printed a
    traceback, which an outage of the whole job never produces (CI, 2026-12-06).
    ``pid`` is the caller's ``Popen`` child and is not reaped here: its ``wait()`` keeps the
    return code (-9), which a reaping wait would turn into 0.
    """
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]  # collected first: orphans are re-parented
    except psutil.NoSuchProcess:
        return
    if sig == signal.SIGKILL:
        for proc in procs:
            _signal(proc, signal.SIGSTOP)
        with contextlib.suppress(psutil.NoSuchProcess):  # children forked while the walk ran
            procs += [p for p in root.children(recursive=True) if p not in procs]
            for proc in procs:
                _signal(proc, signal.SIGSTOP)
    for proc in procs:
        _signal(proc, sig)
    psutil.wait_procs(procs[1:], timeout=60)
    try:
        os.killpg(pid, sig)  # whatever the group started and the tree walk missed
    except (ProcessLookupError, PermissionError):
        pass


def _signal(proc, sig: int) -> None:
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        proc.send_signal(sig)


INNER_TIMEOUT_S = 1500
"""Longest wait for one subprocess of a test: below pytest's per-test limit (pyproject.toml,
timeout = 1800), so a hung subprocess group is killed by us, with its output, never orphaned."""


def run_group(cmd: list[str], *, timeout: float, warm: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` in a process group of its own (``start_new_session``); on timeout the
    whole tree (torchrun agents, ranks in their own sessions, engine and scorer processes) is
    killed, then the test fails with the output so far. Output is captured as text. ``warm``: a
    ``python -m megatron_gtpo...`` command may be forked from the session's warm interpreter
    instead (tests/warm.py: training runs and gloo worlds, never a test about start-up)."""
    assert timeout <= INNER_TIMEOUT_S, f"timeout {timeout} s exceeds INNER_TIMEOUT_S"
    if warm:
        from tests.warm import WARM

        env = kwargs.get("env") or dict(os.environ)
        why = "run_group options other than env and cwd" if set(kwargs) - {"env", "cwd"} else WARM.eligible(cmd, env)
        done = None if why else WARM.run(cmd, timeout=timeout, env=env, cwd=Path(kwargs.get("cwd") or os.getcwd()))
        if done is not None:
            return done
        WARM.note_fresh(why or "the warm server failed")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise AssertionError(f"{cmd[:6]} timed out after {timeout} s; process group killed:\n"
                             f"{(out + err)[-8000:]}") from None
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 600,
             env: dict[str, str] | None = None) -> list[dict]:
    """Runs ``script`` on ``nproc`` gloo ranks and returns every JSON line that any rank printed
    with the prefix ``RESULT `` (the scripts' way of reporting checks).

    The ranks start through ``megatron_gtpo.parallel.launch``, as the training CLI's do: on this
    CPU machine they are forked from one interpreter that imported torch, Megatron-Core and (for
    the scripts that build engines) vLLM once, with torchrun's environment; ``MGTPO_LAUNCHER=torchrun``
    in the environment runs torchrun's own launcher instead. Raises AssertionError with the combined
    output when the launch fails, so a failing rank's traceback appears in the pytest report. Strict
    device groups (megatron_gtpo/parallel/strict.py) are on unless ``env`` or the caller's
    environment sets the variable to 0: host data on a group that would be NCCL on a GPU raises here
    as it would there.
    """
    preload = ["megatron_gtpo.trainer"] + (["vllm"] if "vllm" in Path(script).read_text() else [])
    cmd = [sys.executable, "-m", "megatron_gtpo.parallel.launch", f"--nproc={nproc}", f"--preload={','.join(preload)}",
           str(script), *args]
    full_env = child_env(**{"OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port()), **(env or {})})
    proc = run_group(cmd, timeout=timeout, env=full_env, cwd=REPO, warm=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"launch {script} (nproc={nproc}) failed rc={proc.returncode}:\n{out[-8000:]}"
    return [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def chat_prompt(tokenizer, question: str, *, uid: str, gold: str = ""):
    """``question`` as one user turn under the tokenizer's chat template (generation prompt added)."""
    from megatron_gtpo.types import Prompt

    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    # The template already holds the special tokens (BOS, role headers): do not add them twice.
    return Prompt(uid=uid, token_ids=list(tokenizer(text, add_special_tokens=False)["input_ids"]), text=text, gold=gold)


def expected_versions(steps, *, start: int, staleness: int) -> list[int]:
    """The policy version of the completions each of ``steps`` trains on in a run that started (or
    resumed) at step ``start`` and updates at every step: ``max(step - 1 - staleness, start)``."""
    return [max(step - 1 - staleness, start) for step in steps]


def resident_block(nbytes: int):
    """``nbytes`` of fresh memory, every page written (an anonymous mapping; ``.close()`` frees it).

    Not a tensor or a bytearray: the C allocator serves those from freed heap that is still
    resident when earlier in-process tests (vLLM, Megatron) left enough of it, so the resident set
    would not grow and a peak meter would see nothing (CI once saw 4 KiB of a 128 MiB tensor)."""
    import mmap

    block = mmap.mmap(-1, nbytes)
    for offset in range(0, nbytes, mmap.PAGESIZE):
        block[offset] = 1
    return block


def leave_freed_resident_heap(mib: int):
    """Puts this process in the state a long pytest process reaches: ``mib`` MiB freed in glibc's
    heap, still resident, below a live block (so no automatic trim returns it). Returns that block."""
    import torch

    lift = torch.ones(2 << 20, dtype=torch.uint8)  # freed mmapped block: lifts glibc's mmap threshold
    del lift
    blocks = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(mib)]
    pin = torch.ones(1024)
    del blocks
    return pin


def tiny_tied_llama(out: Path, *, max_positions: int) -> str:
    """A 2-layer random Llama (hidden 128, tied embeddings, seed 0) with SmolLM2's tokenizer in
    ``out``: a model vLLM's CPU attention serves (head_dim 32), in seconds."""
    import shutil

    import torch
    import transformers

    from megatron_gtpo.models.smollm2 import ensure_smollm2

    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=max_positions, tie_word_embeddings=True, bos_token_id=1,
                                      eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    for f in ensure_smollm2().iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, Path(out) / f.name)
    return str(out)


@contextlib.contextmanager
def in_process_engine(model_dir: str, vllm_kwargs: dict):
    """A RolloutEngine in this process (seed 0). It sets VLLM_ENABLE_V1_MULTIPROCESSING=0 for the
    process (rollout/engine.py); restored afterwards, so later tests' subprocesses run vLLM as they
    do on their own."""
    from megatron_gtpo.rollout import RolloutEngine

    before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    engine = RolloutEngine(model_dir=model_dir, seed=0, vllm_kwargs=vllm_kwargs)
    try:
        yield engine
    finally:
        engine.close()
        if before is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = before
