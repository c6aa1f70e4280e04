"""Tests for rollverify_jax.data.synthetic: format, determinism, long tail, vocabulary, splits."""

import re

import numpy as np
import pytest

from rollverify_jax.data import rewards, synthetic
from rollverify_jax.data.synthetic import SyntheticTask, char_vocabulary, make_split

PROMPT_RE = re.compile(r"^Start (\d+)\. ((?:[+\-*]\d+ )*[+\-*]\d+)\. Compute\.$")
STEP_RE = re.compile(r" (\d+)([+\-*])(\d+)=(\d+)\.")


@pytest.fixture(scope="module")
def samples() -> list[dict[str, str]]:
    return make_split(3000, seed=0)


def test_example_format():
    assert (
        synthetic.format_prompt(7, [("+", 3), ("*", 2), ("-", 5), ("+", 8)])
        == "Start 7. +3 *2 -5 +8. Compute."
    )
    solution, value = synthetic.format_solution(7, [("+", 3), ("*", 2), ("-", 5), ("+", 8)])
    assert solution == " 7+3=10. 10*2=20. 20-5=15. 15+8=23. Answer: 23"
    assert value == 23


def test_solution_is_the_prompt_worked_out(samples):
    task = SyntheticTask()
    for record in samples[:500]:
        match = PROMPT_RE.match(record["prompt"])
        assert match, record["prompt"]
        value = int(match.group(1))
        ops = match.group(2).split(" ")
        steps = STEP_RE.findall(record["solution"])
        assert len(steps) == len(ops)
        for (a, op, b, result), written in zip(steps, ops, strict=True):
            assert written == f"{op}{b}" and int(a) == value
            value = synthetic.apply_op(value, op, int(b))
            assert int(result) == value and 0 <= value <= task.max_value
        assert record["solution"].endswith(f" Answer: {value}") and record["answer"] == str(value)
        assert rewards.exact_reward(record["solution"], record["answer"]) == 1.0


def test_deterministic_per_index():
    task = SyntheticTask(seed=3)
    forward = [task.sample(i) for i in range(50)]
    backward = [task.sample(i) for i in reversed(range(50))][::-1]
    assert forward == backward
    assert SyntheticTask(seed=3).sample(17) == forward[17]
    assert make_split(50, seed=3) == forward
    assert make_split(50, seed=4) != forward


def test_sample_accepts_a_generator():
    task = SyntheticTask()
    a = task.sample(np.random.default_rng(5))
    assert a == task.sample(np.random.default_rng(5))
    assert set(a) == {"prompt", "answer", "solution"}


def test_lengths_are_long_tailed(samples):
    lengths = np.array([len(r["solution"]) for r in samples])
    median, p99 = np.percentile(lengths, [50, 99])
    assert p99 >= 3 * median, (median, p99)
    steps = np.array([len(STEP_RE.findall(r["solution"])) for r in samples])
    assert steps.min() >= 1 and steps.max() <= SyntheticTask().max_steps


def test_max_steps_clips():
    steps = [len(STEP_RE.findall(r["solution"])) for r in make_split(300, seed=0, max_steps=3)]
    assert max(steps) == 3 and min(steps) >= 1


def test_vocabulary_covers_every_character(samples):
    vocab = char_vocabulary()
    assert list(vocab) == sorted(set(vocab))
    used = set("".join(r["prompt"] + r["solution"] + r["answer"] for r in samples))
    assert used <= set(vocab), used - set(vocab)
    assert {"0", "9", "+", "-", "*", "=", ".", ":", " ", "A"} <= set(vocab)


def test_train_and_test_splits_are_disjoint():
    train = {r["prompt"] for r in make_split(2000, seed=0, split="train")}
    test = {r["prompt"] for r in make_split(2000, seed=1, split="test")}
    assert not train & test
    everything = make_split(4000, seed=2)
    held_out = np.mean([SyntheticTask(split="test").in_split(r["prompt"]) for r in everything])
    assert 0.05 < held_out < 0.15


def test_gin_binding_reaches_the_synthetic_datasets(spec_of):
    spec = spec_of("SyntheticTask.max_steps = 2", "TrainConfig.train_dataset_kwargs = {'n': 4}")
    assert spec.dataset_kwargs("train") == {"max_steps": 2, "n": 4}
    assert spec.dataset_kwargs("eval") == {"max_steps": 2, "split": "test"}
    assert SyntheticTask().max_steps == 32  # the class itself reads nothing


@pytest.mark.parametrize(
    "kwargs", [{"max_steps": 0}, {"length_median": 0.0}, {"split": "valid"}, {"holdout_fraction": 1.0}]
)
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        SyntheticTask(**kwargs)
