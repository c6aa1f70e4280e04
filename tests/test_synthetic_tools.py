"""Tests for the tool variant of the synthetic task, the tool policy's tokenizer and SFT mask (the recipe
scripts/make_tiny_tool_policy.py, over rl/sft.py) and the committed policy under assets/tiny_tool_policy."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import numpy as np
import pytest

from rollverify_jax.data.datasets import get_dataset
from rollverify_jax.data.rewards import exact_reward
from rollverify_jax.data.synthetic_tools import (
    CALL_END,
    CALL_START,
    REPLY_PREFIX,
    REPLY_SUFFIX,
    TOOL_TAGS,
    SyntheticToolTask,
    apply_op,
    char_vocabulary,
    make_split,
    num_tool_steps,
    parse_ops,
    tool_reply,
)
from rollverify_jax.models.tokenizer import Tokenizer
from rollverify_jax.rl.sft import sft_example
from rollverify_jax.studies import tool_task_errors
from rollverify_jax.tools import evaluate, parse_tool_call
from rollverify_jax.tools.calculator import format_number

ROOT = Path(__file__).resolve().parents[1]
ASSET = ROOT / "assets" / "tiny_tool_policy"
_CALL = re.compile(re.escape(CALL_START) + r"(.*?)" + re.escape(CALL_END) + re.escape(REPLY_PREFIX) + r"(.*?)"
                   + re.escape(REPLY_SUFFIX))
_INLINE = re.compile(r" (\d+)([+-])(\d+)=(\d+)\.")


TASK_KWARGS = json.loads((ASSET / "task.json").read_text())  # the task the committed policy learned


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """The committed tool policy's tokenizer (what the recipe builds: printable ASCII, a token per tool tag)."""
    return Tokenizer.from_dir(ASSET)


def test_problems_are_deterministic_and_seeded():
    task = SyntheticToolTask(seed=3)
    assert [task.sample(i) for i in range(20)] == [SyntheticToolTask(seed=3).sample(i) for i in range(20)]
    assert make_split(20, seed=3) == [task.sample(i) for i in range(20)]
    assert make_split(20, seed=3) != make_split(20, seed=4)


def test_train_and_test_are_disjoint_by_prompt_hash():
    train = {r["prompt"] for r in make_split(400, seed=0, split="train")}
    test = [r["prompt"] for r in make_split(100, seed=0, split="test")]
    assert not train & set(test)
    held_out = SyntheticToolTask(split="test")
    assert all(held_out.in_split(p) for p in test)
    assert not any(SyntheticToolTask(split="train").in_split(p) for p in test)


def test_demonstrations_compute_the_answer_and_their_calls_evaluate_to_their_replies():
    task = SyntheticToolTask(seed=1, split="train")
    for i in range(200):
        example = task.sample(i)
        prompt, solution, answer = example["prompt"], example["solution"], example["answer"]
        ops = parse_ops(prompt)
        value = int(prompt.split()[1].rstrip("."))
        for op, operand in ops:
            value = apply_op(value, op, operand)
            assert 1 <= value <= task.max_value
        assert answer == str(value) and solution.endswith(f" Answer: {answer}")
        assert exact_reward(solution, answer) == 1.0
        calls = _CALL.findall(solution)
        assert 1 <= len(calls) == num_tool_steps(prompt) <= task.max_tool_steps
        for expression, reply in calls:
            assert reply == format_number(evaluate(expression)) == tool_reply(expression)
            assert ("*" in expression) != ("//" in expression)
        for a, op, b, c in _INLINE.findall(solution):
            assert apply_op(int(a), op, int(b)) == int(c) and int(b) <= task.max_operand
        # what the rollout parses at the stop token: the text of the turn up to its first `</calculator>`
        if calls:
            turn = solution[: solution.index(CALL_END) + len(CALL_END)]
            assert parse_tool_call(turn, names=("calculator",)) == ("calculator", calls[0][0])


def test_lengths_keep_a_long_tail_and_tool_steps_are_hard():
    task = SyntheticToolTask(seed=0, split="train")
    prompts = [task.sample(i)["prompt"] for i in range(2000)]
    steps = np.array([len(parse_ops(p)) for p in prompts])
    assert steps.max() <= task.max_steps and np.percentile(steps, 99) >= 4 * np.median(steps)
    operands = [b for p in prompts for op, b in parse_ops(p) if op in ("*", "//")]
    assert min(operands) >= task.min_factor and max(operands) <= task.max_factor
    answers = np.array([int(task.sample(i)["answer"]) for i in range(500)])
    assert np.mean(answers >= 1000) > 0.5  # most answers are big numbers, not guessable without the tool


def test_task_rejects_settings_where_a_step_may_not_fit():
    for bad in ({"min_factor": 1}, {"max_factor": 5}, {"max_value": 1000}, {"tool_fraction": 1.5},
                {"max_tool_steps": 0}, {"split": "dev"}, {"max_start": 0}):
        with pytest.raises(ValueError):
            SyntheticToolTask(**bad)


def test_registered_dataset():
    records = get_dataset("synthetic_tools", n=5, seed=2, split="test")
    assert records == [{"prompt": r["prompt"], "answer": r["answer"]} for r in make_split(5, 2, split="test")]


def test_tokenizer_encodes_every_demonstration_with_each_tag_one_token(tokenizer: Tokenizer):
    for tag in TOOL_TAGS:
        ids = tokenizer.encode(tag)
        assert len(ids) == 1 and tag not in tokenizer.special_tokens
        assert tokenizer.decode(ids, skip_special_tokens=True) == tag  # the reward's decode keeps the tags
    eos = tokenizer.token_id("<|endoftext|>")
    assert tokenizer.eos_ids == (eos,) and tokenizer.decode([eos], skip_special_tokens=True) == ""
    task = SyntheticToolTask(seed=0, split="test")
    for i in range(100):
        example = task.sample(i)
        text = example["prompt"] + example["solution"]
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert sum(ids.count(tokenizer.token_id(tag)) for tag in TOOL_TAGS) == 4 * num_tool_steps(example["prompt"])
    assert tokenizer.decode(tokenizer.encode(char_vocabulary())) == char_vocabulary()
    for refused in ("1//0", "2^3", "x+1", "(1", "'a'", "9**9**9"):  # error replies encode too
        reply = tool_reply(refused)
        assert reply.startswith("Error: ") and tokenizer.decode(tokenizer.encode(reply)) == reply


def test_sft_mask_skips_the_prompt_and_the_replies(tokenizer: Tokenizer):
    task = SyntheticToolTask(seed=0, split="train")
    for i in range(20):
        prompt, segments, _ = task.demonstration(i)
        inputs, targets, weights = sft_example(tokenizer, prompt, segments, "<|endoftext|>")
        seq = tokenizer.encode(prompt + "".join(t for t, _ in segments)) + [tokenizer.token_id("<|endoftext|>")]
        assert inputs == seq[:-1] and targets == seq[1:]
        expected = [0.0] * (len(tokenizer.encode(prompt)) - 1)
        for text, env in segments:
            expected += [0.0 if env else 1.0] * len(tokenizer.encode(text))
        assert weights == [*expected, 1.0]  # EOS is the policy's
        reply_ids = {tokenizer.token_id(REPLY_PREFIX), tokenizer.token_id(REPLY_SUFFIX)}
        call_ids = {tokenizer.token_id(CALL_START), tokenizer.token_id(CALL_END)}
        assert all(w == 0.0 for t, w in zip(targets, weights, strict=True) if t in reply_ids)
        assert all(w == 1.0 for t, w in zip(targets, weights, strict=True) if t in call_ids)
        n_reply = sum(len(tokenizer.encode(text)) for text, env in segments if env)
        assert weights.count(0.0) == len(tokenizer.encode(prompt)) - 1 + n_reply


def test_length_bounds_bound_the_task(tokenizer: Tokenizer):
    task = SyntheticToolTask(seed=0, split="train", **TASK_KWARGS)
    prompt_max, solution_max = task.length_bounds()
    longest = max(range(1000), key=lambda i: len(parse_ops(task.sample(i)["prompt"])))
    for i in [*range(300), longest]:
        example = task.sample(i)
        assert len(tokenizer.encode(example["prompt"])) <= prompt_max
        assert len(tokenizer.encode(example["solution"])) + 1 <= solution_max


def test_committed_tool_policy_fits_its_task_and_is_partly_right():
    from rollverify_jax.models.hf import load_pretrained

    model = load_pretrained(ASSET)
    tokenizer = Tokenizer.from_dir(ASSET, model_vocab_size=model.cfg.vocab_size)
    assert all(len(tokenizer.encode(tag)) == 1 for tag in TOOL_TAGS)
    task = SyntheticToolTask(seed=0, split="test", **json.loads((ASSET / "task.json").read_text()))
    tool_use = json.loads((ASSET / "tool_use.json").read_text())
    assert task.max_tool_steps <= tool_use["max_calls"] and tool_use["call_end_token"] == CALL_END
    example = task.sample(0)
    assert tokenizer.decode(tokenizer.encode(example["prompt"] + example["solution"])) == (
        example["prompt"] + example["solution"])
    match = re.search(r"Held-out sampled accuracy[^:]*:\s*([0-9.]+)", (ASSET / "README.md").read_text())
    assert match and 0.15 <= float(match.group(1)) <= 0.6  # room left for RL (greedy is 0.1 higher)


def test_tool_configs_bind_the_policy_task_and_tool_protocol():
    """configs/tiny_tool_base.gin trains and evaluates on the task the policy learned, with its tool protocol."""
    bindings = {}
    for line in (ROOT / "configs" / "tiny_tool_base.gin").read_text().splitlines():
        if "=" in line and not line.startswith(("#", "include")):
            name, value = line.split("#")[0].split("=", 1)
            bindings[name.strip()] = ast.literal_eval(value.strip())
    assert bindings["TrainConfig.policy_path"] == "assets/tiny_tool_policy"
    for split in ("train", "eval"):
        assert bindings[f"TrainConfig.{split}_dataset"] == "synthetic_tools"
        kwargs = bindings[f"TrainConfig.{split}_dataset_kwargs"]
        assert {k: v for k, v in kwargs.items() if k not in ("n", "split")} == TASK_KWARGS
        assert kwargs["split"] == ("train" if split == "train" else "test")
    tool_use = {k.removeprefix("ToolUseConfig."): v for k, v in bindings.items() if k.startswith("ToolUseConfig.")}
    tool_use["tools"] = list(tool_use["tools"])  # a gin tuple, a JSON list
    protocol = {k: v for k, v in json.loads((ASSET / "tool_use.json").read_text()).items()
                if k not in ("workers", "reply_dispatches")}  # the protocol the policy learned, not scheduling knobs
    assert tool_use == protocol
    prompt_max, solution_max = SyntheticToolTask(**TASK_KWARGS).length_bounds()
    assert bindings["RolloutConfig.max_new_tokens"] >= solution_max
    assert bindings["EngineConfig.max_seq_len"] >= prompt_max + bindings["RolloutConfig.max_new_tokens"]
    for mode in ("rollverify", "onpolicy", "partial"):
        text = (ROOT / "configs" / f"tiny_tool_{mode}.gin").read_text()
        assert "include 'configs/tiny_tool_base.gin'" in text and "Hardware: one CPU" in text


def test_error_report_finds_the_first_wrong_step_of_a_response():
    """rollverify_jax.studies.tool_task_errors replays a response against its prompt: a demonstration passes every
    step; a flipped sign, a wrong sum and a miscopied value are each named at the step where they happen."""
    errors = tool_task_errors
    task = SyntheticToolTask(seed=0, split="all")
    example = next(e for e in map(task.sample, range(200))
                   if num_tool_steps(e["prompt"]) and _INLINE.search(e["solution"]))
    prompt, solution = example["prompt"], example["solution"]
    assert errors.first_error(prompt, solution).startswith("none")
    a, op, b, c = _INLINE.search(solution).groups()
    step = f" {a}{op}{b}={c}."
    flipped = f" {a}{'-' if op == '+' else '+'}{b}={c}."
    wrong_sum = f" {a}{op}{b}={int(c) + 1}."
    assert errors.first_error(prompt, solution.replace(step, flipped, 1)) == "inline step: wrong operator"
    assert errors.first_error(prompt, solution.replace(step, wrong_sum, 1)).startswith("inline arithmetic")
    call = _CALL.search(solution).group(1)
    left = re.match(r"\d+", call).group(0)
    miscopied = solution.replace(CALL_START + call, CALL_START + str(int(left) + 1) + call[len(left):], 1)
    assert errors.first_error(prompt, miscopied) == "copy of the previous value"
