"""Multi-turn tool use in the rollout (the tool environment behind the scheduler's environment seam): replies
appended without re-prefill, tool tokens outside verification, pause and resume across a call (checkpoint
round-trip included), faults that never hold a slot, environments that keep their own tools and limits."""

import dataclasses
import json
import random
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.rl.batch import build_batch
from rollverify_jax.rl.buffer import PausedCache
from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig, Scheduler, Trajectory
from rollverify_jax.rollout.stats import RolloutStats
from rollverify_jax.rollout.tool_use import ToolEnvironment, ToolUseConfig
from rollverify_jax.run.checkpoint import decode_extra, encode_extra
from rollverify_jax.tools import SandboxConfig, ToolRegistry, ToolResult, ToolStatus
from rollverify_jax.verify import ShiftStats, coupled_keep, two_stage_verify

CALL_END = 63  # the tiny random policy samples it now and then: each time, a tool call ends its turn
EOS = 3
CFG = EngineConfig(num_slots=4, page_size=8, max_seq_len=96, steps_per_dispatch=3)
TOOLS = ToolUseConfig(enabled=True, tools=("calculator",), call_end_token="<end>", reply_prefix="<r>",
                      reply_suffix="</r>", max_calls=3, max_reply_tokens=5)


def _encode(text: str) -> list[int]:
    """Reply text to ids of the 64-token toy vocabulary, never the EOS nor the call-end id."""
    return [10 + ord(c) % 50 for c in text]


def _decode(ids) -> str:
    return "".join(chr(48 + i % 60) for i in ids)


class GatedRunner(ToolEnvironment):
    """A tool environment whose calls wait for ``gate`` (a tool that runs until its timeout)."""

    def __init__(self, config=TOOLS, gate: threading.Event | None = None):
        super().__init__(config, _encode, _decode, CALL_END)
        self.gate = gate

    def _run(self, text):
        if self.gate is not None:
            self.gate.wait(10)
        return super()._run(text)


class SlowRunner(ToolEnvironment):
    """A tool environment whose calls take ``delay`` seconds (a reply that is not in yet when the phase pauses),
    or with ``jitter`` (a seed) a random pick of 0, 1, 10 or 30 ms each: a tool whose latency varies from run to
    run."""

    def __init__(self, config=TOOLS, delay: float = 0.05, jitter: int | None = None):
        super().__init__(config, _encode, _decode, CALL_END)
        self.delay = delay
        self.rng = None if jitter is None else random.Random(jitter)

    def _run(self, text):
        time.sleep(self.delay if self.rng is None else self.rng.choice([0.0, 0.001, 0.01, 0.03]))
        return super()._run(text)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, CFG, SamplingConfig(temperature=1.0), eos_ids=(EOS,), stop_ids=(CALL_END,))


def _requests(n=12, seed=0, max_new=60):
    rng = np.random.default_rng(seed)
    return [Trajectory(uid=i, group_id=i, prompt=rng.integers(4, 64, size=rng.integers(2, 10)).astype(np.int32),
                       seed=70 + i, max_new_tokens=max_new) for i in range(n)]


def _run_all(engine, trajs, tools=None):
    sched = Scheduler(engine, tools or GatedRunner())
    sched.submit(trajs)
    sched.run()
    assert engine.allocator.num_free == engine.allocator.capacity, "pages leaked"
    return {t.uid: t for t in sched.take_finished()}


def _teacher_forced_logp(model, t: Trajectory) -> np.ndarray:
    seq = np.concatenate([t.prompt, np.asarray(t.tokens, np.int32)])
    logits = nnx.jit(lambda m, x: m(x))(model, seq[None])[0]
    logp = jax.nn.log_softmax(logits, axis=-1)
    p = len(t.prompt)
    return np.asarray([logp[p + j - 1, y] for j, y in enumerate(t.tokens)])


@pytest.fixture(scope="module")
def reference(engine):
    return _run_all(engine, _requests())


def test_replies_are_appended_and_the_policy_reads_them_as_a_full_recompute_would(model, engine, reference):
    called = [t for t in reference.values() if t.tool_calls]
    assert len(called) >= 3 and any(t.tool_calls >= 2 for t in called)
    reply = GatedRunner().reply_tokens(ToolResult("", ToolStatus.ERROR, 0.0, "no tool call found before the "
                                                  "closing tag"), room=100)
    for t in called:
        mask = t.policy_mask()
        for start, end in t.env_spans:
            assert t.tokens[start - 1] == CALL_END and mask[start - 1]  # each reply follows a call's closing tag
            assert t.tokens[start:end] == reply[: end - start] and not mask[start:end].any()
            assert t.logps[start:end] == [0.0] * (end - start)
        # Every sampled token's log mu is what the whole sequence recomputed from scratch gives: the reply's K/V
        # written by Engine.extend (and the closing tag's) are the ones a full prefill computes.
        np.testing.assert_allclose(np.asarray(t.logps)[mask], _teacher_forced_logp(model, t)[mask], atol=1e-4)
    assert all(t.tool_calls <= TOOLS.max_calls for t in reference.values())


def test_a_call_past_the_budget_ends_the_trajectory(engine, reference):
    capped = _run_all(engine, _requests(), GatedRunner(ToolUseConfig(**{**_fields(TOOLS), "max_calls": 1})))
    for uid, t in capped.items():
        assert t.tool_calls <= 1
        if reference[uid].tool_calls >= 2:  # the same samples up to the second call, which now ends it
            assert t.tokens[-1] == CALL_END and t.finished


def _fields(config):
    return {f: getattr(config, f) for f in config.__dataclass_fields__}


def test_replies_keep_history_cached_and_prefill_only_their_own_tokens(engine):
    sched = Scheduler(engine, GatedRunner())
    trajs = _requests()
    sched.submit(trajs)
    sched.run()
    calls = sum(t.tool_calls for t in trajs)
    reply_tokens = sum(b - a for t in trajs for a, b in t.env_spans)
    assert sched.stats.extend_tokens == reply_tokens + calls  # each reply plus the closing tag before it
    assert sched.stats.prefill_tokens <= sum(len(t.prompt) for t in trajs)  # no history is prefilled again
    assert sched.env.stats.calls == calls and sched.env.stats.errors == calls  # random text: no valid call


@pytest.mark.parametrize("dispatches", [2, 5, 10])
def test_pause_mid_turn_or_while_a_tool_runs_then_a_checkpoint_then_resume_is_exact(engine, reference, dispatches):
    """Replies due 3 dispatches after their calls (which take 20 ms): a pause finds calls still running, takes
    their replies, and the resumed run samples what the unpaused one did."""
    sched = Scheduler(engine, SlowRunner(ToolUseConfig(**{**_fields(TOOLS), "reply_dispatches": 3}), delay=0.02))
    sched.submit(_requests())
    sched.run(max_dispatches=dispatches)
    for _ in range(8):  # on to the next dispatch that leaves calls running (mid-turn slots decode meanwhile)
        if sched.waits:
            break
        sched.step()
    waiting = len(sched.waits)
    paused = sched.pause_all()
    assert engine.allocator.num_free == engine.allocator.capacity
    cache = PausedCache()
    cache.pause(paused)
    restored = PausedCache.from_dict(decode_extra(json.loads(json.dumps(encode_extra(cache.to_dict())))))
    sched.resume(restored.paused)
    done = {**{t.uid: t for t in sched.take_finished()}, **_finish(sched)}
    assert sorted(done) == sorted(reference)
    for uid, t in reference.items():
        assert done[uid].tokens == t.tokens and done[uid].env_spans == t.env_spans, uid
        np.testing.assert_allclose(done[uid].logps, t.logps, atol=1e-4)
    assert waiting > 0  # calls were running at the pause: their replies were waited for


@pytest.mark.parametrize("delay", [0.5, 0.0])
def test_a_pause_takes_every_reply_however_long_it_takes(engine, reference, delay):
    """Which parked slots hold their reply at a pause never depends on how long the calls take: calls parked by
    the dispatch just read (half a second each, or none) are all waited for, and the samples are the unpaused run's."""
    env = SlowRunner(delay=delay)
    sched = Scheduler(engine, env)
    sched.submit(_requests())
    while not sched.waits:  # stop at the dispatch that parks the first slots: their calls just started
        sched.step()
    parked = [w.traj for w in sched.waits.values()]
    spans, calls = {t.uid: len(t.env_spans) for t in parked}, env.stats.calls
    paused = sched.pause_all()
    assert engine.allocator.num_free == engine.allocator.capacity
    for t in parked:
        assert len(t.env_spans) == spans[t.uid] + 1 and not env.awaits_reply(t), t.uid
    assert env.stats.calls == calls + len(parked)
    sched.resume(paused)
    done = {**{t.uid: t for t in sched.take_finished()}, **_finish(sched)}
    for uid, t in reference.items():
        assert done[uid].tokens == t.tokens and done[uid].env_spans == t.env_spans, uid


def _trace(sched, pause_at: int) -> list:
    """Per step up to ``pause_at``: what finished, what runs in which slot, what waits in which slot; then what the
    pause returns (uid, tokens, reply spans)."""
    out = []
    for _ in range(pause_at):
        sched.step()
        out.append((sorted(t.uid for t in sched.take_finished()), sorted((s, t.uid) for s, t in sched.slots.items()),
                    sorted((s, w.traj.uid) for s, w in sched.waits.items())))
    return out + [[(t.uid, t.num_tokens, t.env_spans) for t in sched.pause_all()]]


@pytest.mark.parametrize("reply_dispatches", [1, 3])
def test_what_a_rollout_batches_and_pauses_does_not_depend_on_tool_latency(engine, reply_dispatches):
    """Two runs whose calls take other random times (0 to 30 ms, while a dispatch takes a few) finish, run, park
    and pause the same trajectories at every step: a reply joins at the dispatch fixed when it was asked for."""
    config = ToolUseConfig(**{**_fields(TOOLS), "reply_dispatches": reply_dispatches})
    traces = []
    for jitter in (1, 2):
        sched = Scheduler(engine, SlowRunner(config, jitter=jitter))
        sched.submit(_requests(48, seed=2))
        traces.append(_trace(sched, 60))
        assert sched.env.stats.calls >= 8
    assert traces[0] == traces[1]


def _finish(sched):
    sched.run()
    assert sched.engine.allocator.num_free == sched.engine.allocator.capacity
    return {t.uid: t for t in sched.take_finished()}


def test_verification_reads_policy_tokens_only(engine):
    """Same params at the resume: every policy token is on-policy (OPS ~ 0) and nothing is cut, though each
    reply token's recorded log mu (0.0) is far from its log-prob: were reply tokens verified, they would be cut."""
    sched = Scheduler(engine, GatedRunner())
    sched.submit(_requests())
    sched.run(max_dispatches=7)
    paused = [t for t in sched.pause_all() if t.env_spans]
    assert paused
    seen = []

    def keep_fn(new_logp, behavior, versions, lengths):
        seen.append((np.array(new_logp), np.array(behavior), np.array(lengths)))
        return two_stage_verify(new_logp, behavior, versions, lengths, 0.01, 2.0)

    policy_tokens = {t.uid: int(t.policy_mask().sum()) for t in paused}
    assert any(policy_tokens[t.uid] < t.num_tokens for t in paused)
    sched.resume(paused, keep=keep_fn)
    sched.run(max_dispatches=1)
    assert sched.verified and all(k == n for k, n in sched.verified)  # acceptance 1: nothing cut
    for t in paused:
        event = [h for h in t.history if h["event"] == "verify"][-1]
        assert event["of"] == event["kept"] == policy_tokens[t.uid]  # the acceptance counts policy tokens
    for new, behavior, lengths in seen:  # the verifier saw each policy token's log pi beside its own log mu
        for i in np.flatnonzero(lengths):
            np.testing.assert_allclose(new[i, : lengths[i]], behavior[i, : lengths[i]], atol=1e-4)
    _finish(sched)


def test_the_coupled_rule_skips_replies_and_its_resume_under_new_weights_samples_as_from_scratch(model, engine):
    """The coupled rule over tool turns: under the same weights every policy token is kept (reply tokens, which the
    policy did not sample and its check would reject, are skipped); under moved weights, trajectories paused with
    replies in them, verified and completed equal the new weights' rollout from scratch, tool turns included."""
    shift = ShiftStats()

    def coupled(new_logp, behavior, versions, lengths, match=None):
        shift.merge(ShiftStats.of(new_logp, behavior, versions, lengths, engine.version, match))
        return coupled_keep(match, lengths)

    sched = Scheduler(engine, GatedRunner(), coupled=True)
    sched.submit(_requests())
    sched.run(max_dispatches=7)
    paused = sched.pause_all()
    assert any(t.env_spans for t in paused)
    policy_tokens = sum(int(t.policy_mask().sum()) for t in paused)
    sched.resume(paused, keep=coupled)
    sched.run(max_dispatches=1)
    assert sched.verified and all(k == n for k, n in sched.verified)
    # the per-token agreement and the TV estimate count the policy's tokens only, every one of them agreeing
    assert sum(shift.coupled_tokens.values()) == sum(shift.tokens.values()) == policy_tokens
    assert shift.metrics()["verify/token_agreement"] == 1.0 and shift.metrics()["verify/tv_estimate"] < 1e-3
    sched.pause_all()
    original = nnx.state(model)
    rng = np.random.default_rng(3)
    moved = jax.tree.map(lambda x: x + 0.02 * rng.standard_normal(x.shape).astype(x.dtype), original)
    try:
        engine.update_params(moved, version=1)
        fresh = _run_all(engine, _requests())
        engine.update_params(original, version=0)
        sched = Scheduler(engine, GatedRunner(), coupled=True)
        sched.submit(_requests())
        sched.run(max_dispatches=7)
        paused = sched.pause_all() + sched.take_finished()  # finished ones are verified too
        engine.update_params(moved, version=1)
        sched.resume(paused, keep=coupled)
        done = {**{t.uid: t for t in sched.take_finished()}, **_finish(sched)}
    finally:
        engine.update_params(original, version=0)
    assert 0 < sum(k for k, _ in sched.verified) < sum(n for _, n in sched.verified)  # some kept, some cut
    assert any(t.env_spans for t in fresh.values())
    for uid, t in fresh.items():
        assert done[uid].tokens == t.tokens and done[uid].env_spans == t.env_spans, uid


def test_a_cut_lands_on_a_policy_token_and_removes_every_later_turn(engine):
    sched = Scheduler(engine, GatedRunner())
    sched.submit(_requests())
    sched.run()
    t = max(sched.take_finished(), key=lambda t: t.tool_calls)
    assert t.tool_calls >= 2
    policy_at = np.flatnonzero(t.policy_mask())
    first_end = t.env_spans[0][1]
    cut = int(np.searchsorted(policy_at, first_end))  # the first policy token after the first reply
    tokens, spans = list(t.tokens), list(t.env_spans)
    sched.resume([t], keep=lambda new, behavior, versions, lengths: np.where(lengths > 0, cut, 0))
    sched.step()  # admission: the resume prefill, the verification, the cut
    assert sched.verified_finished == [(cut, len(policy_at))] and policy_at[cut] == first_end
    assert t.num_tokens >= first_end + 1 and t.tokens[:first_end] == tokens[:first_end]
    assert t.env_spans[0] == spans[0] and t.draws == 1  # the first turn and its reply stay, the rest is redrawn
    _finish(sched)


def test_a_tool_that_overruns_its_timeout_gets_an_error_reply_and_frees_its_slot(engine):
    slow = GatedRunner(ToolUseConfig(**{**_fields(TOOLS), "timeout_s": 0.2}), gate=threading.Event())
    slow.overrun_s = 0.0  # no sandbox whose own timeout reply to wait for: the environment's deadline answers
    done = _run_all(engine, _requests(4), slow)  # the gate stays shut: only the timeout ends a call
    called = [t for t in done.values() if t.tool_calls]
    assert called and slow.stats.errors == slow.stats.calls == sum(t.tool_calls for t in called)
    timeout = slow.reply_tokens(ToolResult("", ToolStatus.TIMEOUT, 0.2, "the call ran past 0.2 s"), room=100)
    assert called[0].tokens[slice(*called[0].env_spans[0])] == timeout[: called[0].env_spans[0][1]
                                                                        - called[0].env_spans[0][0]]
    slow.gate.set()


TEXT = (lambda x: [ord(ch) for ch in x], lambda ids: "".join(map(chr, ids)))  # a codec that round-trips


def _called(env: ToolEnvironment, calls: list[str]) -> list[str]:
    """Every call of ``calls`` requested at once (as parked slots do), then answered in order, as the scheduler
    takes each at its due dispatch (``reply`` waits for it); the replies' text."""
    requests = []
    for i, call in enumerate(calls):
        turn = TEXT[0](call)
        t = Trajectory(uid=i, group_id=i, prompt=np.asarray([5], np.int32), seed=0, max_new_tokens=256,
                       tokens=turn, logps=[0.0] * len(turn), versions=[0] * len(turn))
        assert env.awaits_reply(t)
        requests.append(env.request(t))
    return [TEXT[1](env.reply(r, room=200)) for r in requests]


def test_a_calls_wait_for_a_worker_never_counts_in_its_timeout():
    """32 calls of 0.1 s at once on 4 workers with a 0.4 s limit: each runs and is answered with its own output
    (the limit used to count from the submission: 16 of them timed out, most without ever running)."""
    ran = []

    class Sleep:
        name, description = "nap", ""

        def call(self, arguments):
            time.sleep(0.1)
            ran.append(arguments)
            return ToolResult(f"slept {arguments}", ToolStatus.OK, 0.1)

    config = ToolUseConfig(tools=("nap",), call_end_token=">", timeout_s=0.4, workers=4)
    env = ToolEnvironment(config, *TEXT, ord(">"), registry=ToolRegistry([Sleep()]))
    replies = _called(env, [f"<nap>{i}</nap>" for i in range(32)])
    assert replies == [f"<tool_response>slept {i}</tool_response>" for i in range(32)]
    assert sorted(ran, key=int) == [str(i) for i in range(32)]
    metrics = env.phase_metrics([], 1.0, RolloutStats(), 1)
    assert (metrics["tools/calls"], metrics["tools/timeouts"], metrics["tools/errors"]) == (32, 0, 0)
    assert metrics["tools/queue_wait_s"] > 0  # 28 of them waited for a worker
    env.close()


def test_a_call_past_its_timeout_reads_the_tools_own_timeout_reply_with_what_it_printed():
    """A tool that enforces its own limit (as the sandbox does) answers with its output so far: the environment's
    deadline comes after it, so a generic error never replaces that reply."""
    class Overrun:
        name, description = "spin", ""

        def call(self, arguments):
            time.sleep(0.3)  # past the 0.1 s limit: the tool stops itself, keeping what it printed
            return ToolResult(f"{arguments} so far", ToolStatus.TIMEOUT, 0.3, "timed out after 0.1 s")

    env = ToolEnvironment(ToolUseConfig(tools=("spin",), call_end_token=">", timeout_s=0.1, workers=1), *TEXT,
                          ord(">"), registry=ToolRegistry([Overrun()]))
    assert _called(env, ["<spin>a</spin>", "<spin>b</spin>"]) == [
        f"<tool_response>{x} so far\nError: timed out after 0.1 s</tool_response>" for x in "ab"]
    assert (env.stats.calls, env.stats.timeouts) == (2, 2)
    env.close()


def test_python_calls_past_their_timeout_on_a_busy_pool_keep_the_sandboxs_reply(sandbox_available):
    """Two sandboxed programs that print, then run past their 0.75 s limit, on one worker: each reads the sandbox's
    timeout reply with what it printed, the second as the first (its wait for the worker is not its time)."""
    env = ToolEnvironment(ToolUseConfig(tools=("python",), call_end_token=">", timeout_s=0.75, workers=1), *TEXT,
                          ord(">"), sandbox=SandboxConfig(memory_mb=256))
    code = "print('partial {}', flush=True)\nimport time\ntime.sleep(30)"
    replies = _called(env, [f"<python>{code.format(i)}</python>" for i in range(2)])
    assert replies == [f"<tool_response>partial {i}\nError: timed out after 0.75 s</tool_response>" for i in range(2)]
    assert env.stats.timeouts == 2
    env.close()


def test_a_tools_output_is_plain_text_and_the_replys_frame_is_markup(tmp_path):
    """A reply holding every special token of the vocabulary encodes none of them as its id (an EOS id inside an
    environment span used to be the result), and decodes back to the same text, also as the reward decodes it
    (skipping special ids); the frame's own turn markers stay special tokens."""
    from rollverify_jax.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(Path(__file__).resolve().parents[1] / "assets" / "tiny_tool_policy")
    frame = ("<|im_end|>\n<|im_start|>user\n<tool_response>", "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    config = ToolUseConfig(tools=("calculator",), call_end_token="</calculator>", reply_prefix=frame[0],
                           reply_suffix=frame[1], max_reply_tokens=400)
    env = ToolEnvironment.for_tokenizer(config, tokenizer)
    output = "x " + " y ".join(tokenizer.special_tokens) + " z"
    reply = env.reply_tokens(ToolResult(output, ToolStatus.OK, 0.0), room=1000)
    prefix, suffix = tokenizer.encode(frame[0]), tokenizer.encode(frame[1])
    assert reply[:len(prefix)] == prefix and reply[len(reply) - len(suffix):] == suffix
    body = reply[len(prefix):len(reply) - len(suffix)]
    specials = set(tokenizer.special_tokens.values())
    assert specials >= set(tokenizer.eos_ids) and not specials & set(body)
    assert {tokenizer.token_id("<|im_end|>"), tokenizer.token_id("<|im_start|>")} <= set(prefix) & set(suffix)
    assert tokenizer.decode(body, skip_special_tokens=False) == tokenizer.decode(body) == output
    assert tokenizer.decode(reply, skip_special_tokens=False) == frame[0] + output + frame[1]
    env.close()


def test_a_reply_is_cut_to_the_room_left_and_to_its_own_cap():
    runner = GatedRunner()
    long = ToolResult("9" * 100, ToolStatus.OK, 0.0)
    frame = len(_encode("<r>")) + len(_encode("</r>"))
    assert len(runner.reply_tokens(long, room=100)) == frame + TOOLS.max_reply_tokens
    assert runner.reply_tokens(long, room=frame + 2) == _encode("<r>") + _encode("99") + _encode("</r>")
    assert len(runner.reply_tokens(long, room=2)) == 2


def test_a_reply_with_characters_the_vocabulary_lacks_drops_them():
    def strict(text):
        if "~" in text:
            raise ValueError(f"cannot encode {text!r}")
        return _encode(text)
    runner = ToolEnvironment(TOOLS, strict, _decode, CALL_END)
    assert runner.reply_tokens(ToolResult("1~2", ToolStatus.OK, 0.0), room=100) == strict("<r>12</r>")


def test_the_loss_mask_leaves_tool_replies_out():
    t = Trajectory(uid=0, group_id=0, prompt=np.asarray([5, 6], np.int32), seed=0, max_new_tokens=20,
                   tokens=[9, 9, CALL_END], logps=[-1.0, -1.0, -1.0], versions=[0, 0, 0])
    t.append_env([11, 12, 13], version=1)
    t.tokens.append(9), t.logps.append(-0.5), t.versions.append(1)
    batch = build_batch([t], np.asarray([1.0]))
    np.testing.assert_array_equal(batch["loss_mask"][0, :8], [0, 0, 1, 1, 1, 0, 0, 0])
    assert batch["loss_mask"][0, 8] == 1
    t.truncate(4)  # inside the reply: its span is cut with it
    assert t.env_spans == [(3, 4)] and t.policy_mask().tolist() == [True, True, True, False]


def test_a_pool_split_over_devices_extends_as_one_device_does(model, engine, reference):
    mesh = mesh_lib.make_mesh((2, 2, 2))
    sharded = Engine(model, CFG, SamplingConfig(temperature=1.0), eos_ids=(EOS,), stop_ids=(CALL_END,), mesh=mesh)
    assert sharded.allocator.num_shards == 4
    done = _run_all(sharded, _requests())
    for uid, t in reference.items():
        assert done[uid].tokens == t.tokens, uid
        np.testing.assert_allclose(done[uid].logps, t.logps, atol=1e-4)


def test_waiting_slots_are_packed_with_the_running_ones(model, engine):
    """16 slots decode over live-slot buckets (8, 16): slots waiting for a reply move down with the running ones."""
    cfg = EngineConfig(num_slots=16, page_size=8, max_seq_len=96, steps_per_dispatch=3)
    eng = Engine(model, cfg, SamplingConfig(temperature=1.0), eos_ids=(EOS,), stop_ids=(CALL_END,))
    a, b = _run_all(eng, _requests(12, seed=3)), _run_all(engine, _requests(12, seed=3))
    assert any(t.tool_calls for t in a.values())
    for uid in a:
        assert a[uid].tokens == b[uid].tokens, uid


def test_bad_tool_settings_are_refused():
    with pytest.raises(ValueError, match="max_calls"):
        ToolUseConfig(max_calls=0)
    with pytest.raises(ValueError, match="tools is empty"):
        ToolUseConfig(tools=())
    with pytest.raises(ValueError, match="unknown tool|Unknown tool|known"):
        ToolEnvironment(ToolUseConfig(tools=("nope",)), _encode, _decode, CALL_END)


def test_two_environments_in_one_process_keep_their_own_tools_and_limits():
    """Each environment builds its own registry from its config and the run's sandbox limits: building a second
    one (other tools, other limits) changes nothing the first calls, and a tool one holds the other cannot reach."""
    a = ToolEnvironment(ToolUseConfig(tools=("python",), timeout_s=2.0), _encode, _decode, CALL_END,
                        sandbox=SandboxConfig(memory_mb=256))
    python_a = a.registry.get("python")
    b = ToolEnvironment(ToolUseConfig(tools=("calculator", "python"), timeout_s=5.0), _encode, _decode, CALL_END)
    assert a.registry.get("python") is python_a and python_a.config.timeout_s == 2.0  # the call's limit
    assert python_a.config.memory_mb == 256 and b.registry.get("python").config.memory_mb == 1024
    assert b.registry.get("python").config.timeout_s == 5.0 and "calculator" not in a.registry
    echo = type("Echo", (), {"name": "echo", "description": "", "call": lambda self, x: ToolResult(x, "ok", 0.0)})
    text = TEXT
    c = ToolEnvironment(ToolUseConfig(tools=("echo",)), *text, ord(">"), registry=ToolRegistry([echo()]))
    d = ToolEnvironment(ToolUseConfig(tools=("calculator",)), *text, ord(">"))
    assert "echo" not in a.registry and "echo" not in b.registry
    turn = text[0]("<echo>hi</echo>")
    t = Trajectory(uid=0, group_id=0, prompt=np.asarray([5], np.int32), seed=0, max_new_tokens=64, tokens=turn,
                   logps=[0.0] * len(turn), versions=[0] * len(turn))
    for env, expected in ((c, "<tool_response>hi</tool_response>"),
                          (d, "<tool_response>Error: no tool call found before the closing tag</tool_response>")):
        assert env.awaits_reply(t)
        assert text[1](env.reply(env.request(t), room=100)) == expected  # reply waits for the call
    for env in (a, b, c, d):
        env.close()


def test_the_sandbox_limits_are_a_spec_part_the_environment_is_built_with(spec_of):
    spec = spec_of("SandboxConfig.memory_mb = 512", "ToolUseConfig.tools = ('python',)",
                   "ToolUseConfig.timeout_s = 3.0")
    assert spec.sandbox.memory_mb == 512 and spec.settings()["sandbox.memory_mb"] == 512  # compared on resume
    assert spec_of().settings()["sandbox.memory_mb"] == 1024
    with pytest.raises(ValueError, match=r"SandboxConfig\.timeout_s is set by the code"):  # ToolUseConfig.timeout_s
        spec_of("SandboxConfig.timeout_s = 3.0")

    class Tokenizer:
        def token_id(self, token):
            return {"<end>": CALL_END}[token]

        encode, decode = staticmethod(_encode), staticmethod(lambda ids, skip_special_tokens: _decode(ids))

    env = ToolEnvironment.for_tokenizer(dataclasses.replace(spec.tool_use, call_end_token="<end>"), Tokenizer(),
                                        spec.sandbox)
    python = env.registry.get("python").config
    assert env.call_end_id == CALL_END and (python.memory_mb, python.timeout_s) == (512, 3.0)
    env.close()
    with pytest.raises(ValueError, match="not one token"):
        ToolEnvironment.for_tokenizer(spec.tool_use, Tokenizer(), spec.sandbox)


@pytest.mark.parametrize("loss_name", ["grpo", "gspo", "vespo"])
def test_tool_replies_move_neither_the_loss_nor_the_train_time_ops(loss_name):
    """The reply tokens' recorded log mu (0.0) is nothing like their log-prob under any policy: were they in the
    loss mask, the loss, its gradient and the OPS metric would follow whatever they hold."""
    from rollverify_jax.rl.losses import LossConfig, get_loss_fn

    t = Trajectory(uid=0, group_id=0, prompt=np.asarray([5, 6], np.int32), seed=0, max_new_tokens=20,
                   tokens=[9, 9, CALL_END], logps=[-1.0, -1.2, -0.9], versions=[0, 0, 0])
    t.append_env([11, 12, 13], version=1)
    t.tokens.extend([9, 3]), t.logps.extend([-0.5, -0.7]), t.versions.extend([1, 1])
    batch = build_batch([t], np.asarray([1.0]))
    new_logp = batch["behavior_logp"] + 0.05 * batch["loss_mask"]
    loss_fn = get_loss_fn(loss_name)

    def run(behavior):
        return jax.value_and_grad(lambda lp: loss_fn(lp, behavior, batch["advantages"], batch["loss_mask"],
                                                     LossConfig())[0])(new_logp), \
            loss_fn(new_logp, behavior, batch["advantages"], batch["loss_mask"], LossConfig())[1]

    (loss, grad), metrics = run(batch["behavior_logp"])
    env = batch["loss_mask"] == 0
    scrambled = np.where(env, -30.0, batch["behavior_logp"])  # any value on reply and prompt positions
    (loss2, grad2), metrics2 = run(scrambled)
    np.testing.assert_allclose(loss, loss2, rtol=1e-6)
    np.testing.assert_allclose(grad, grad2, rtol=1e-6)
    np.testing.assert_allclose(metrics["ops/token_mean"], metrics2["ops/token_mean"], rtol=1e-6)
    assert np.all(np.asarray(grad)[env] == 0)


@pytest.mark.parametrize("block_tokens", [8, 24, 4096])  # one page a block, three pages, the whole table at once
def test_extend_attention_over_blocks_of_pages_equals_dense_attention(monkeypatch, block_tokens):
    from rollverify_jax.rollout import engine as engine_lib

    monkeypatch.setattr(engine_lib, "EXTEND_BLOCK_TOKENS", block_tokens)
    rng = np.random.default_rng(0)
    n, w, hq, hkv, d, pages, size, pps = 3, 4, 4, 2, 8, 12, 8, 5
    q = rng.normal(size=(n, w, hq, d)).astype(np.float32)
    k_pages = rng.normal(size=(hkv, pages, size, d)).astype(np.float32)
    v_pages = rng.normal(size=(hkv, pages, size, d)).astype(np.float32)
    table = np.stack([rng.permutation(np.arange(1, pages))[:pps] for _ in range(n)]).astype(np.int32)
    positions = np.asarray([[10, 11, 12, 13], [0, 1, 2, 3], [35, 36, 37, 38]], np.int32)
    out = np.asarray(engine_lib._attend_own_pages(*map(jax.numpy.asarray, (q, k_pages, v_pages, table, positions)),
                                                  ()))
    for i in range(n):
        k = k_pages[:, table[i]].reshape(hkv, -1, d)  # [Hkv, T, D] of row i, in position order
        v = v_pages[:, table[i]].reshape(hkv, -1, d)
        for j in range(w):
            keys = positions[i, j] + 1
            for h in range(hq):
                scores = k[h // (hq // hkv), :keys] @ q[i, j, h]
                p = np.exp(scores - scores.max())
                np.testing.assert_allclose(out[i, j, h], (p / p.sum()) @ v[h // (hq // hkv), :keys], atol=1e-5)
