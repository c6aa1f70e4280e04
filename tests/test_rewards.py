"""Tests for rollverify_jax.data.rewards: extraction, equivalence, overlong penalty, the grader pool."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollverify_jax.data import rewards
from rollverify_jax.data.rewards import (
    RewardScorer,
    RewardSpec,
    exact_reward,
    extract_answer,
    extract_answer_line,
    extract_boxed,
    get_reward_fn,
    math_equal,
    overlong_penalty,
)

TIMEOUT_S = 1.0
GRACE_S = 2.0


def faulty_grader(response: str, answer: str) -> float:
    """Module-level (picklable) grader whose answer selects a failure mode; otherwise it grades math."""
    if answer == "sleep":
        time.sleep(60)  # interruptible: the worker's alarm fires
    if answer == "hang":
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
        time.sleep(60)  # the alarm cannot fire: only the parent's hard deadline ends this
    if answer == "crash":
        time.sleep(0.2)
        os._exit(3)
    if answer == "raise":
        raise RuntimeError("grader bug")
    if answer == "ok":
        return 1.0
    if answer == "pid":  # slow enough that every worker takes some of a batch
        time.sleep(0.3)
        return float(os.getpid())
    if answer in ("nan", "inf", "huge"):
        return {"nan": float("nan"), "inf": float("-inf"), "huge": 1e300}[answer]  # 1e300 is inf in float32
    return rewards.math_reward(response, answer)


def limits_grader(response: str, answer: str) -> float:
    """Reports the worker's limits, or hogs what they bound (module-level, cheap to start: no math_verify)."""
    import resource

    if answer == "memory":
        return float(len(bytearray(1536 * 2**20)))  # 1.5 GiB: past a 1 GiB address-space limit
    if answer.startswith("spin:"):  # CPU-bound Python: only the CPU-time limit (far shorter than the alarm) ends it
        received = []
        worker_handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGALRM, signal.SIGXCPU)}

        def note(signum, frame):  # writes down the signal, then hands it to the worker's own handler
            received.append(signal.Signals(signum).name)
            worker_handlers[signum](signum, frame)

        for sig in worker_handlers:
            signal.signal(sig, note)
        try:
            while True:
                pass
        except rewards.GraderTimeout:  # the worker's handler raised it: write down why, the worker counts it
            Path(answer.removeprefix("spin:")).write_text(json.dumps({
                "signals": received, "alarm_left_s": signal.getitimer(signal.ITIMER_REAL)[0]}))  # 0: it fired
            raise
        finally:
            for sig, handler in worker_handlers.items():
                signal.signal(sig, handler)
    if answer == "as_limit":
        return float(resource.getrlimit(resource.RLIMIT_AS)[0] // 2**20)
    if answer == "pid":
        return float(os.getpid())
    return 1.0


@pytest.fixture(scope="module")
def scorer():
    """One pool for the module: spawning graders is the slow part."""
    s = RewardScorer("math", timeout_s=TIMEOUT_S, num_workers=2, hard_timeout_grace_s=GRACE_S)
    yield s
    s.close()


@pytest.fixture
def faulty(scorer, monkeypatch):
    """The shared scorer with its grader swapped; workers receive the function by reference per item."""
    monkeypatch.setattr(scorer, "spec", RewardSpec(fn=faulty_grader, isolated=True))
    return scorer


# -- extraction ---------------------------------------------------------------------------------------------


def test_answer_line_takes_the_last_occurrence():
    text = "Answer: 5 is wrong\nlet me redo\nanswer:  7 \n"
    assert extract_answer_line(text) == "7"
    assert extract_answer_line("no answer here") is None


def test_boxed_handles_nesting_and_takes_the_last():
    assert extract_boxed(r"so \boxed{\frac{1}{\sqrt{2}}} done") == r"\frac{1}{\sqrt{2}}"
    assert extract_boxed(r"\boxed{1} then \boxed{ {2} + 3 }") == "{2} + 3"
    assert extract_boxed(r"\boxed{4} and \boxed{unclosed") == "4"
    assert extract_boxed("nothing") is None


def test_extract_answer_prefers_the_answer_line():
    assert extract_answer("\\boxed{3}\nAnswer: 4") == "4"
    assert extract_answer("Answer: $\\boxed{\\frac{1}{2}}$.") == r"\frac{1}{2}"
    assert extract_answer("Answer: $12$") == "12"
    assert extract_answer("the result is \\boxed{\\dfrac{3}{4}}") == r"\dfrac{3}{4}"
    assert extract_answer("no final answer") is None


def test_exact_reward():
    assert exact_reward(" 7+3=10. Answer: 10", "10") == 1.0
    assert exact_reward(" 7+3=10. Answer:  10  ", " 10") == 1.0
    assert exact_reward(" 7+3=10. Answer: 11", "10") == 0.0
    assert exact_reward(" 7+3=10.", "10") == 0.0


def test_math_equivalence():
    assert math_equal(r"\frac{1}{2}", "0.5")
    assert math_equal("1,000", "1000")
    assert math_equal(r"\frac{\sqrt{2}}{2}", r"\sqrt{2}/2")
    assert not math_equal("23", "24")


def test_registry():
    assert get_reward_fn("math") is rewards.math_reward and get_reward_fn("exact") is exact_reward
    assert set(rewards.REWARDS) >= {"math", "exact"}
    with pytest.raises(ValueError, match="known rewards: .*exact.*math"):
        get_reward_fn("nope")


# -- overlong penalty ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "length, expected", [(50, 0.0), (80, 0.0), (85, -0.25), (90, -0.5), (100, -1.0), (101, -1.0), (500, -1.0)]
)
def test_overlong_penalty_values(length, expected):
    assert overlong_penalty(length, max_length=100, buffer=20) == pytest.approx(expected)


def test_overlong_penalty_is_added_to_the_reward():
    s = RewardScorer("exact", overlong_buffer=20, max_response_length=100)
    responses = ["Answer: 3", "Answer: 3", "Answer: 4", "Answer: 3"]
    got, metrics = s.score(responses, ["3"] * 4, response_lengths=[10, 90, 90, 120])
    np.testing.assert_allclose(got, [1.0, 0.5, -0.5, 0.0])
    assert got.dtype == np.float32
    assert metrics["reward/overlong_fraction"] == 0.75
    with pytest.raises(ValueError, match="response_lengths"):
        s.score(responses, ["3"] * 4)
    correct, metrics = s.score(responses, ["3"] * 4, overlong_penalty=False)  # evaluation: correctness only
    np.testing.assert_allclose(correct, [1.0, 1.0, 0.0, 1.0])
    assert metrics["reward/overlong_fraction"] == 0.0
    with pytest.raises(ValueError, match="max_response_length"):
        RewardScorer("exact", overlong_buffer=20)


# -- the scorer and its pool --------------------------------------------------------------------------------


def test_score_math_batch(scorer):
    responses = [
        "so x = 1/2\nAnswer: \\frac{1}{2}",
        "we get \\boxed{0.5}",
        "Answer: 3",
        "I give up",
    ]
    got, metrics = scorer.score(responses, ["0.5", "\\frac{1}{2}", "4", "1"])
    np.testing.assert_array_equal(got, np.array([1, 1, 0, 0], np.float32))
    assert metrics["reward/mean"] == 0.5 and metrics["reward/grader_timeouts"] == 0.0
    assert metrics["reward/grader_errors"] == 0.0
    empty, _ = scorer.score([], [])
    assert empty.shape == (0,)
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        scorer.score(["a", "b"], ["a"])


def test_slow_grade_times_out_without_killing_the_pool(faulty):
    """The worker's own alarm ends the grade and the worker lives on; the parent's hard deadline (which kills and
    replaces the worker) is not what stopped it."""
    faulty.score(["Answer: 1"], ["ok"])  # a pool is up
    workers = sorted(faulty.worker_pids())
    got, metrics = faulty.score(["Answer: 2"] * 3, ["sleep", "ok", "2"])
    np.testing.assert_array_equal(got, [0.0, 1.0, 1.0])
    assert metrics["reward/grader_timeouts"] == 1.0 and metrics["reward/grader_pool_restarts"] == 0.0
    assert metrics["reward/grader_worker_restarts"] == 0.0 and sorted(faulty.worker_pids()) == workers


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_hung_worker_alone_is_killed_and_replaced(faulty):
    faulty.score(["Answer: 1"], ["ok"])  # a pool is up: these are the workers the hang will meet
    workers = faulty.worker_pids()
    # Left alone, the hang sleeps 60 s and then grades 0 with no timeout counted: the counts below show the
    # parent's deadline ended it.
    got, metrics = faulty.score(["Answer: 2"] * 4, ["hang", "ok", "ok", "2"])
    np.testing.assert_array_equal(got, [0.0, 1.0, 1.0, 1.0])
    assert metrics["reward/grader_timeouts"] == 1.0 and metrics["reward/grader_worker_restarts"] == 1.0
    assert metrics["reward/grader_pool_restarts"] == 0.0
    alive = [_alive(pid) for pid in workers]
    assert alive.count(False) == 1, "the hung worker must be killed, not left asleep; the other keeps running"
    for _ in range(50):  # its replacement starts on pebble's next tick
        if len(faulty.worker_pids()) == 2:
            break
        time.sleep(0.1)
    assert len(faulty.worker_pids()) == 2


def test_crashing_grader_is_an_error_and_the_others_are_graded(faulty):
    got, metrics = faulty.score(["Answer: 2"] * 4, ["ok", "crash", "ok", "raise"])
    np.testing.assert_array_equal(got, [1.0, 0.0, 1.0, 0.0])
    assert metrics["reward/grader_errors"] == 2.0 and metrics["reward/grader_timeouts"] == 0.0
    assert metrics["reward/grader_worker_restarts"] == 2.0  # the crash, then its retry alone


def test_worker_killed_while_idle_is_replaced(scorer):
    scorer.score(["Answer: 1"], ["1"])  # make sure a pool is up
    victim = scorer.worker_pids()[0]
    os.kill(victim, signal.SIGKILL)
    got, metrics = scorer.score(["Answer: 1", "Answer: 2", "Answer: 3"], ["1", "2", "4"])
    np.testing.assert_array_equal(got, [1.0, 1.0, 0.0])
    assert metrics["reward/grader_errors"] == 0.0 and metrics["reward/grader_timeouts"] == 0.0
    assert victim not in scorer.worker_pids() and len(scorer.worker_pids()) == 2


def test_workers_ignore_sigint_and_sigterm(faulty):
    """A Ctrl-C or a scheduler's SIGTERM reaches every process of the job: the graders must outlive it, since
    the trainer finishes its step (and grades it) before it stops."""
    workers = {int(pid) for pid in faulty.score(["x"] * 8, ["pid"] * 8)[0]}
    assert len(workers) == 2
    for pid in workers:  # sent by another process (kill(1)), as a terminal or a scheduler would
        subprocess.run(["kill", "-INT", str(pid)], check=True)
        subprocess.run(["kill", "-TERM", str(pid)], check=True)
    time.sleep(1.0)
    assert all(_alive(pid) for pid in workers)
    got, metrics = faulty.score(["Answer: 1", "Answer: 2"] + ["x"] * 8, ["1", "3"] + ["pid"] * 8)
    np.testing.assert_array_equal(got[:2], [1.0, 0.0])
    assert {int(pid) for pid in got[2:]} == workers and metrics["reward/grader_errors"] == 0.0


def test_a_nonfinite_grade_is_a_grader_error_not_a_nan_reward(faulty, capsys):
    """A NaN grade used to reach the advantages and the loss (and end the run with advice about the learning
    rate); now it scores 0, is counted as a grader error, and one warning says what happened."""
    got, metrics = faulty.score(["Answer: 2"] * 4, ["nan", "inf", "huge", "ok"])
    np.testing.assert_array_equal(got, [0.0, 0.0, 0.0, 1.0])
    assert metrics["reward/grader_errors"] == 3.0 and metrics["reward/grader_nonfinite"] == 3.0
    assert np.isfinite(metrics["reward/mean"])
    err = capsys.readouterr().err
    assert "returned a non-finite grade (NaN or inf) for 3 of 4 responses" in err
    inline = RewardScorer("exact")  # inline rewards too
    inline.spec = RewardSpec(fn=faulty_grader, isolated=False)
    got, metrics = inline.score(["Answer: 2"] * 2, ["nan", "ok"])
    np.testing.assert_array_equal(got, [0.0, 1.0])
    assert metrics["reward/grader_nonfinite"] == 1.0


def broken_reward(response: str, answer: str):
    """A plug-in as users write them by mistake: it raises, or returns text instead of a number."""
    if answer == "text":
        return "correct"
    if answer == "ok":
        return 1.0
    raise KeyError("ground_truth")


def test_a_reward_that_cannot_grade_warns_and_evaluation_counts_it(capsys):
    """A plug-in that raises (or returns text) on every item used to score 0 in silence: the run learned nothing
    and evaluation reported accuracy 0.0. One warning names the reward, the share and the first error; it comes
    again only when most of a batch fails anew."""
    scorer = RewardScorer("exact")
    scorer.spec = RewardSpec(fn=broken_reward, isolated=False)
    got, metrics = scorer.score(["x"] * 4, ["a", "b", "c", "d"])
    np.testing.assert_array_equal(got, [0.0] * 4)
    assert metrics["reward/grader_errors"] == 4.0
    err = capsys.readouterr().err
    assert "reward 'exact' could not grade 4 of 4 responses (4 errors, 0 timeouts" in err, err
    assert "the first: KeyError: 'ground_truth'" in err and "likely broken" in err, err
    scorer.score(["x"] * 4, ["a", "b", "c", "d"])  # failing still: already said
    assert capsys.readouterr().err == ""
    scorer.score(["x"] * 4, ["ok", "ok", "ok", "a"])  # a few errors after the first warning: counted, not warned
    assert capsys.readouterr().err == ""
    got, metrics = scorer.score(["x"] * 2, ["text", "text"])  # most fail again: warned again, text named
    err = capsys.readouterr().err
    assert "could not grade 2 of 2" in err and "returned 'correct' (str), not a number" in err, err
    assert metrics["reward/grader_nonfinite"] == 0.0


def test_each_worker_is_limited_in_memory_and_cpu_time(tmp_path):
    """A grade past the worker's address space fails alone (a MemoryError in the worker, not the host's OOM
    killer); a CPU-bound grade is stopped by its CPU-time limit (1 s) while its alarm (60 s, however loaded the
    machine) is still pending; the worker survives both."""
    with RewardScorer("exact", timeout_s=60.0, num_workers=1, memory_limit_mb=1024, cpu_limit_s=1.0) as s:
        s.spec = RewardSpec(fn=limits_grader, isolated=True)
        got, _ = s.score(["x", "x"], ["as_limit", "pid"])
        assert got[0] == 1024.0
        pid = got[1]
        got, metrics = s.score(["x"] * 4, ["memory", f"spin:{tmp_path / 'stopped.json'}", "ok", "pid"])
    np.testing.assert_array_equal(got, [0.0, 0.0, 1.0, pid])  # the same worker graded all of them
    assert metrics["reward/grader_errors"] == 1.0 and metrics["reward/grader_timeouts"] == 1.0
    assert metrics["reward/grader_worker_restarts"] == 0.0
    stopped = json.loads((tmp_path / "stopped.json").read_text())
    # RLIMIT_CPU's SIGXCPU, through the worker's handler, ended the grade; the alarm never fired.
    assert stopped["signals"] == ["SIGXCPU"] and stopped["alarm_left_s"] > 0.0, stopped


def test_scorer_recovers_after_faults(faulty):
    before = faulty.totals["timeouts"]
    faulty.score(["Answer: 2"] * 2, ["sleep", "crash"])
    got, metrics = faulty.score(["Answer: 42", "Answer: 41"], ["42", "42"])
    np.testing.assert_array_equal(got, [1.0, 0.0])
    assert metrics["reward/grader_timeouts"] == 0.0 and metrics["reward/grader_errors"] == 0.0
    assert faulty.totals["timeouts"] == before + 1  # totals accumulate over calls


def test_gin_configurable(spec_of):
    s = RewardScorer(**spec_of("RewardScorer.name = 'exact'", "RewardScorer.timeout_s = 3.0").reward)
    try:
        assert s.name == "exact" and s.timeout_s == 3.0
    finally:
        s.close()
    with pytest.raises(ValueError, match="unknown reward"):
        RewardScorer("bogus")


def test_rewards_under_load_with_hanging_and_crashing_graders_land_on_their_own_items(faulty):
    """60 responses, 5% hang past their alarm and 5% kill their worker, spread through the batch: every other
    item gets exactly its own reward (answers alternate right and wrong, so a shifted reward shows), the faults
    are counted, and the batch ends (each hang costs one deadline, each crash a pool restart). The fault drill
    (scripts/fault_drill.py) runs the same at 1,000 responses."""
    n = 60
    rng = np.random.default_rng(0)
    faults = rng.permutation(n)[:6]
    answers = [str(i + (i % 2)) for i in range(n)]  # even items right, odd items wrong
    for k, i in enumerate(faults):
        answers[i] = "hang" if k % 2 else "crash"
    got, metrics = faulty.score([f"Answer: {i}" for i in range(n)], answers)
    want = np.asarray([float(i % 2 == 0) for i in range(n)], np.float32)
    want[faults] = 0.0
    np.testing.assert_array_equal(got, want)
    # A hang left alone grades 0 after 60 s with no timeout counted: each was ended by its deadline.
    assert metrics["reward/grader_timeouts"] == 3 and metrics["reward/grader_errors"] == 3


@pytest.mark.parametrize("response, answer, expected", [
    ("so the total is 1000.\nAnswer: 1,000", "1000", 1.0),              # thousands separator
    ("Answer: \\boxed{5}", "5", 1.0),                                     # boxed inside the line
    ("Answer: x = 12 degrees", "12", 1.0),                               # right side of '=', unit dropped
    ("Answer: $\\frac12$", "\\frac{1}{2}", 1.0),                          # shorthand \frac, $ delimiters
    ("Answer: \\text{(B)}", "(B)", 1.0),
    ("Answer: 7\nAnswer: 8", "7", -1.0),                                  # the last Answer: counts
    ("the answer is 7", "7", -1.0),                                       # no Answer: line
    ("Answer: 7" + " filler" * 60, "7", -1.0),                          # outside the last 300 characters
    ("Answer: 1/2", "0.5", -1.0),                                         # string match, not symbolic
])
def test_dapo_reward_follows_the_dapo_rule(response, answer, expected):
    assert rewards.dapo_math_reward(response, answer) == expected
    assert rewards.get_reward_fn("dapo") is rewards.dapo_math_reward


def test_dapo_reward_counts_minus_one_as_incorrect():
    s = RewardScorer("dapo")
    r, m = s.score(["Answer: 3", "Answer: 4"], ["3", "3"], overlong_penalty=False)
    np.testing.assert_array_equal(r, [1.0, -1.0])
    assert m["reward/correct_fraction"] == 0.5


def test_reward_plug_in_runs_in_the_grader_pool(tmp_path, monkeypatch):
    (tmp_path / "my_reward_pkg").mkdir()
    (tmp_path / "my_reward_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_reward_pkg" / "graders.py").write_text(
        "import os\n"
        "def length_match(response, answer):\n"
        "    return float(len(response) == int(answer)) + os.getpid() * 0\n"
        "def three_args(response, answer, extra):\n"
        "    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with RewardScorer("my_reward_pkg.graders:length_match", num_workers=1, timeout_s=30) as s:
        assert s.spec.isolated
        r, _ = s.score(["abc", "ab"], ["3", "3"], overlong_penalty=False)
    np.testing.assert_array_equal(r, [1.0, 0.0])
    with pytest.raises(ValueError, match="cannot import 'my_reward_pkg.nope'"):
        RewardScorer("my_reward_pkg.nope:f")
    with pytest.raises(ValueError, match="has no function 'missing'"):
        RewardScorer("my_reward_pkg.graders:missing")
    with pytest.raises(ValueError, match=r"must take \(response: str, answer: str\)"):
        RewardScorer("my_reward_pkg.graders:three_args")


# -- verl and TRL reward functions, a reward per data source ------------------------------------------------


def verl_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature: a dict with 'score' for one source, a number for the other (verl's files return both)."""
    correct = solution_str.strip().endswith(ground_truth)
    if data_source == "dict_source":
        return {"score": 2.0 * correct, "acc": correct}
    return float(correct) + 10.0 * (extra_info or {}).get("bonus", 0)


def trl_accuracy(prompts, completions, answer, **kwargs):
    """TRL's signature: a batch in, one score per completion out (conversational when the record has messages)."""
    scores = []
    for prompt, completion, gold in zip(prompts, completions, answer, strict=True):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        chat_ok = not isinstance(completion, list) or prompt[0]["role"] == "system"
        scores.append(float(chat_ok and text.strip().endswith(gold)))
    return scores


def trl_needs_solution(prompts, completions, solution):
    return [1.0] * len(completions)


def test_verl_and_trl_rewards_per_data_source(monkeypatch):
    """Each record is graded by its data source's reward (verl's compute_score with its dict or float return, a
    TRL batch function called one item at a time), the rest by the default; metrics per source."""
    for name, fn in (("t_verl", verl_compute_score), ("t_trl", trl_accuracy), ("t_trl_solution", trl_needs_solution)):
        monkeypatch.setitem(rewards._REGISTRY, name, None)  # removed again after the test
        monkeypatch.setitem(rewards.REWARDS, name, None)
        rewards.register_reward(name, fn, isolated=False)
    assert rewards.get_reward_spec("t_verl").style.style == "verl"
    assert rewards.get_reward_spec("t_trl").style.style == "trl"
    s = RewardScorer("exact", by_data_source={"verl_source": "t_verl", "dict_source": "t_verl", "trl_source": "t_trl"})
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "4?"}]
    records = [{"prompt": "3?", "answer": "3", "data_source": "verl_source", "extra_info": {"bonus": 1}},
               {"prompt": "3?", "answer": "3", "data_source": "dict_source"},
               {"prompt": "4?", "answer": "4", "data_source": "trl_source"},
               {"prompt": "4?", "answer": "4", "data_source": "trl_source", "messages": chat},
               {"prompt": "Start 5. Compute.", "answer": "5"}]
    responses = ["so 3", "so 3", "so 4", "so 4", "Answer: 5"]
    got, metrics = s.score(responses, [r["answer"] for r in records], overlong_penalty=False, records=records)
    np.testing.assert_array_equal(got, [11.0, 2.0, 1.0, 1.0, 1.0])
    assert metrics["reward/grader_errors"] == 0.0
    assert metrics["reward/verl_source/mean"] == 11.0 and metrics["reward/unknown/mean"] == 1.0
    positional, _ = s.score(responses, [r["answer"] for r in records], None, False)  # the old API: the default
    np.testing.assert_array_equal(positional, [0.0, 0.0, 0.0, 0.0, 1.0])
    needs = RewardScorer("exact", by_data_source={"trl_source": "t_trl_solution"})
    with pytest.raises(ValueError, match=r"by_data_source\['trl_source'\].*needs the column\(s\) \['solution'\], "
                                         r"which record 0 \(data_source 'trl_source'\) does not give"):
        needs.score(["so 4"], ["4"], records=[records[2]])
    with pytest.raises(ValueError, match=r"by_data_source\['x'\]: unknown reward 'nope'"):
        RewardScorer("exact", by_data_source={"x": "nope"})


def test_a_verl_reward_file_sees_the_whole_verl_record_in_the_pool(tmp_path, monkeypatch):
    """End to end: a verl parquet (system message, data_source, nested extra_info) loaded by the verl loader, graded
    in the grader pool by a verl reward *file* ('/path/file.py:compute_score', loaded inside the worker) and by a
    TRL function from a module, per data source; what the functions received is exactly what the file holds."""
    from rollverify_jax.data.datasets import get_dataset

    extra = [{"index": i, "split": "train", "meta": {"tags": ["add"], "difficulty": 0.5 * i}} for i in range(2)]
    system = {"role": "system", "content": "You are a careful solver."}
    rows = [{"data_source": "my_source", "prompt": [system, {"role": "user", "content": f"{i} + {i}?"}],
             "ability": "math", "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
             "extra_info": extra[i]} for i in range(2)]
    rows.append({"data_source": "trl_source", "prompt": [system, {"role": "user", "content": "3 + 4?"}],
                 "ability": "math", "reward_model": {"ground_truth": "7", "style": "rule"},
                 "extra_info": {"index": 2, "split": "train", "meta": {"tags": [], "difficulty": 0.0}}})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    records = get_dataset("verl_parquet", path=str(tmp_path / "train.parquet"))
    log = tmp_path / "received.jsonl"
    (tmp_path / "verl_reward.py").write_text(
        "import json\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if data_source != 'warmup':\n"
        f"        with open({str(log)!r}, 'a') as f:\n"
        "            f.write(json.dumps([data_source, solution_str, ground_truth, extra_info]) + '\\n')\n"
        "    return {'score': float(solution_str.strip().endswith(ground_truth)), 'acc': 1.0}\n"
        "def two_args(data_source, solution_str):\n"
        "    return 0.0\n")
    (tmp_path / "trl_pkg").mkdir()
    (tmp_path / "trl_pkg" / "__init__.py").write_text("")
    (tmp_path / "trl_pkg" / "rewards.py").write_text(
        "def accuracy(prompts, completions, ground_truth, data_source, meta, **kwargs):\n"
        "    ok = prompts[0][0]['role'] == 'system' and completions[0][0]['role'] == 'assistant'\n"
        "    ok = ok and data_source == ['trl_source'] and meta == [{'tags': [], 'difficulty': 0.0}]\n"
        "    return [float(ok and completions[0][0]['content'].endswith(ground_truth[0]))]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reward_file = tmp_path / "verl_reward.py"
    by_source = {"my_source": f"{reward_file}:compute_score", "trl_source": "trl_pkg.rewards:accuracy"}
    with RewardScorer("exact", num_workers=1, timeout_s=30, by_data_source=by_source) as s:
        assert all(spec.isolated for spec in s.source_specs.values())
        got, metrics = s.score(["so 0", "so 3", "so 7"], [r["answer"] for r in records], overlong_penalty=False,
                               records=records)
    np.testing.assert_array_equal(got, [1.0, 0.0, 1.0])
    assert metrics["reward/grader_errors"] == 0.0 and metrics["reward/my_source/mean"] == 0.5
    assert metrics["reward/extra/acc"] == 1.0  # the other numbers of verl's dict are logged, graded in the pool
    received = [json.loads(line) for line in log.read_text().splitlines()]
    assert received == [["my_source", "so 0", "0", extra[0]], ["my_source", "so 3", "2", extra[1]]]
    with pytest.raises(ValueError, match=r"must take \(response: str, answer: str\) -> float, or be verl's "
                                         r"compute_score\(data_source, solution_str, ground_truth"):
        RewardScorer(f"{reward_file}:two_args")
    with pytest.raises(ValueError, match="defines no function 'missing'"):
        RewardScorer(f"{reward_file}:missing")
    assert RewardScorer(str(reward_file)).spec.style.style == "verl"  # a bare file path: its compute_score


# -- multi-turn trajectories: what the reward sees --------------------------------------------------------------


@pytest.mark.parametrize("spans, num_tokens, expected", [
    ([], 7, (2, 0)),  # single turn: the prompt and one response, verl's single_turn_agent_loop says 2
    ([], 0, (2, 0)),  # an empty response was still one generation
    ([(5, 9)], 15, (4, 1)),  # call, reply, final answer: user + assistant + tool + assistant
    ([(5, 9), (12, 14)], 20, (6, 2)),
    ([(5, 9), (9, 12)], 20, (4, 2)),  # two replies back to back answer calls made together: one round, as in verl
    ([(12, 14), (5, 9)], 20, (6, 2)),  # order does not matter
    ([(5, 9)], 9, (3, 1)),  # the response ends on the reply (the budget ran out): no generation after it
])
def test_num_turns_counts_as_verl_counts(spans, num_tokens, expected):
    from rollverify_jax.data.plugins import interaction_turns

    assert interaction_turns(spans, num_tokens) == expected


def test_with_interaction_adds_num_turns_and_tool_calls_only_to_multi_turn_trajectories():
    """A single-turn run's records reach the reward untouched (the same object); a tool agent's record, a response
    with a tool reply, or any record of a multi-turn rollout gets a copy whose extra_info adds num_turns and
    tool_calls (replacing a value the file holds under those names, as verl does); the record itself is unchanged."""
    from rollverify_jax.data.plugins import with_interaction

    plain = {"prompt": "1+1?", "answer": "2", "data_source": "s", "extra_info": {"index": 0, "num_turns": 9}}
    bare = {"prompt": "1+1?", "answer": "2"}
    agent = {"prompt": "1+1?", "answer": "2", "agent_name": "tool_agent"}
    single = {**agent, "agent_name": "single_turn_agent", "extra_info": {"tools_kwargs": {"t": {}}}}
    assert with_interaction(plain, [], 5) is plain and with_interaction(bare, [], 5) is bare
    assert with_interaction(single, [], 5) is single  # named single-turn: its tools_kwargs do not make it a tool's
    assert with_interaction(agent, [], 5) == {**agent, "extra_info": {"num_turns": 2, "tool_calls": 0}}
    assert with_interaction(plain, [(2, 4)], 6)["extra_info"] == {"index": 0, "num_turns": 4, "tool_calls": 1}
    assert with_interaction(bare, [], 5, multi_turn=True)["extra_info"] == {"num_turns": 2, "tool_calls": 0}
    assert plain["extra_info"] == {"index": 0, "num_turns": 9} and "extra_info" not in agent


def test_old_rewards_see_single_turn_records_as_before_and_multi_turn_ones_see_the_interaction(monkeypatch):
    """Inline, every convention: a verl compute_score gets extra_info None for a record without one (as before),
    the record's own extra_info for a single-turn one, and num_turns / tool_calls added for a multi-turn one; a TRL
    function gets them as columns of their own; a rollverify function sees the response only."""
    from rollverify_jax.data.plugins import with_interaction

    seen = []

    def verl_fn(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(extra_info)
        return 1.0

    def trl_fn(prompts, completions, answer, **kwargs):
        seen.append({k: v for k, v in kwargs.items() if k in ("num_turns", "tool_calls")})
        return [1.0]

    for name, fn in (("t_verl_turns", verl_fn), ("t_trl_turns", trl_fn)):
        monkeypatch.setitem(rewards._REGISTRY, name, None)
        monkeypatch.setitem(rewards.REWARDS, name, None)
        rewards.register_reward(name, fn, isolated=False)
    records = [{"prompt": "p", "answer": "2", "data_source": "v"},
               {"prompt": "p", "answer": "2", "data_source": "v", "extra_info": {"index": 1}},
               {"prompt": "p", "answer": "2", "data_source": "v", "agent_name": "tool_agent"},
               {"prompt": "p", "answer": "2", "data_source": "t", "agent_name": "tool_agent"},
               {"prompt": "p", "answer": "2", "data_source": "t"}]
    spans = [[], [], [(3, 6), (9, 10)], [(3, 6)], []]
    graded = [with_interaction(r, s, 12) for r, s in zip(records, spans, strict=True)]
    s = RewardScorer("exact", by_data_source={"v": "t_verl_turns", "t": "t_trl_turns"})
    got, metrics = s.score(["x"] * 5, ["2"] * 5, overlong_penalty=False, records=graded)
    np.testing.assert_array_equal(got, [1.0] * 5)
    assert metrics["reward/grader_errors"] == 0.0
    assert seen == [None, {"index": 1}, {"num_turns": 6, "tool_calls": 2}, {"num_turns": [4], "tool_calls": [1]}, {}]


def test_a_retool_style_reward_file_reads_num_turns_in_the_pool(tmp_path):
    """ReTool's reward (verl's recipe: extra_info without a default, ``**kwargs``, ``extra_info["num_turns"]`` to
    soften the penalty of a wrong answer that called tools) graded in the grader pool on tool agent records."""
    from rollverify_jax.data.plugins import with_interaction

    (tmp_path / "retool_reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs):\n"
        "    score = 1.0 if solution_str.strip().endswith(ground_truth) else -1.0\n"
        "    if score < 0:\n"
        "        score = min(-0.6, score + (extra_info['num_turns'] - 2) / 2 * 0.1)\n"
        "    return {'score': score, 'pred': solution_str[-3:]}\n")
    record = {"prompt": "Find x.", "answer": "204", "data_source": "aime_2024", "agent_name": "tool_agent"}
    cases = [("so 204", []), ("so 7", []), ("so 7", [(2, 4)]), ("so 7", [(2, 4), (5, 6), (7, 8), (9, 10)])]
    graded = [with_interaction(record, spans, 12) for _, spans in cases]
    with RewardScorer(f"{tmp_path / 'retool_reward.py'}:compute_score", num_workers=1, timeout_s=30) as s:
        got, metrics = s.score([text for text, _ in cases], ["204"] * 4, overlong_penalty=False, records=graded)
    np.testing.assert_allclose(got, [1.0, -1.0, -0.9, -0.6])
    assert metrics["reward/grader_errors"] == 0.0
