"""Tests for the recipe scripts/make_tiny_policy.py (run as its CLI) and the committed embedded default under
assets/tiny_policy."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rollverify_jax.data.synthetic import SyntheticTask, char_vocabulary, num_ops
from rollverify_jax.models.hf import load_pretrained
from rollverify_jax.models.tokenizer import Tokenizer
from rollverify_jax.rl import sft

ROOT = Path(__file__).resolve().parents[1]
ASSET = ROOT / "assets" / "tiny_policy"
EOS = "<|endoftext|>"


def _check_policy_dir(path: Path) -> None:
    """What every consumer of the policy relies on: HF weights, a tokenizer that fits them, the task."""
    model = load_pretrained(path)
    tokenizer = Tokenizer.from_dir(path, model_vocab_size=model.cfg.vocab_size)
    assert tokenizer.vocab_size <= model.cfg.vocab_size
    assert model.cfg.vocab_size % 8 == 0
    assert tokenizer.eos_ids[0] == tokenizer.token_id(EOS)
    assert tokenizer.decode(tokenizer.eos_ids[:1], skip_special_tokens=False) == EOS
    assert tokenizer.pad_id is not None and tokenizer.pad_id not in tokenizer.eos_ids
    assert tokenizer.decode(tokenizer.encode(char_vocabulary())) == char_vocabulary()
    task_kwargs = json.loads((path / "task.json").read_text())
    task = SyntheticTask(seed=0, split="test", **task_kwargs)
    example = task.sample(0)
    assert tokenizer.decode(tokenizer.encode(example["prompt"] + example["solution"])) == (
        example["prompt"] + example["solution"]
    )
    longest = task.max_steps * 12 + 64  # generous bound on prompt + solution for this task
    assert model.cfg.max_position_embeddings >= longest


def _sampled_accuracy(readme: str) -> float:
    match = re.search(r"Held-out sampled accuracy[^:]*:\s*([0-9.]+)", readme)
    assert match, "README.md must report the held-out sampled accuracy"
    return float(match.group(1))


@pytest.mark.end_to_end  # the recipe's CLI, a whole training run: started first under xdist (conftest.py)
def test_recipe_learns_and_writes_a_loadable_policy(tmp_path):
    """The CLI end to end on a smaller model: 30 SFT steps take the loss well below the first batch's (the recipe
    learns), and the directory it writes is a policy the configs can load."""
    out = tmp_path / "policy"
    model = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16}
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_tiny_policy.py"), "--steps", "30", "--schedule-steps", "30",
         "--seed", "1", "--out", str(out), "--batch-rows", "4", "--eval-problems", "4", "--num-samples", "1",
         "--eval-batch", "4", "--model", json.dumps(model)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    _check_policy_dir(out)
    readme = (out / "README.md").read_text()
    first, final = (float(x) for x in re.search(r"first batch's loss ([0-9.]+), final loss ([0-9.]+)", readme).groups())
    assert final < 0.8 * first, (first, final)
    assert "SFT steps: 30," in readme and 0.0 <= _sampled_accuracy(readme) <= 1.0
    assert json.loads((out / "task.json").read_text()) == json.loads((ASSET / "task.json").read_text())


def test_length_bounds_bound_the_task():
    task = SyntheticTask(seed=0, **json.loads((ASSET / "task.json").read_text()))
    prompt_max, solution_max = task.length_bounds()
    samples = [task.sample(i) for i in range(2000)]
    assert max(len(s["prompt"]) for s in samples) <= prompt_max
    assert max(len(s["solution"]) + 1 for s in samples) <= solution_max
    assert all(num_ops(s["prompt"]) == s["solution"].count("=") for s in samples)


def test_evaluation_samples_with_the_package_engine():
    """The recipe evaluates with the package's engine and scheduler (``sft.Sampler``): greedy responses
    equal a teacher-forced argmax decode of the same model, and stop at EOS."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from rollverify_jax.models.qwen3 import init_model, model_config

    tokenizer = Tokenizer.from_dir(ASSET)
    model = init_model(model_config("tiny", vocab_size=-(-tokenizer.vocab_size // 8) * 8, num_hidden_layers=2), seed=3)
    sampler = sft.Sampler(model, tokenizer, prompt_len=16, max_new=6, slots=4, eos=EOS)
    prompts = ["Start 3. +4. Compute.", "Start 9. *2 -1. Compute."]
    got = [t.tokens for t in sampler.generate(prompts, seed=0, greedy=True)]
    eos = tokenizer.token_id(EOS)
    logits = nnx.jit(lambda m, ids: m(ids))  # one compile: causal, so right padding does not change a position
    for prompt, response in zip(prompts, got, strict=True):
        seq = tokenizer.encode(prompt)
        want = []
        for _ in range(6):
            ids = seq + want
            nxt = int(jnp.argmax(logits(model, np.asarray([ids + [0] * (32 - len(ids))], np.int32))[0, len(ids) - 1]))
            want.append(nxt)
            if nxt == eos:
                break
        assert response == want


def test_committed_tiny_policy():
    _check_policy_dir(ASSET)
    assert 0.2 <= _sampled_accuracy((ASSET / "README.md").read_text()) <= 0.6
    size = sum(f.stat().st_size for f in ASSET.iterdir() if f.is_file())
    assert size < 20 * 2**20
