"""Engine correctness: paged decoding vs full recompute, behaviour log-probs, determinism, sharding."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig, Scheduler, Trajectory
from rollverify_jax.rollout import engine as engine_lib

CFG = EngineConfig(num_slots=4, page_size=8, max_seq_len=64, steps_per_dispatch=4)


@pytest.fixture(scope="module")
def greedy_engine(model):
    return Engine(model, CFG, SamplingConfig(greedy=True))


@pytest.fixture(scope="module")
def sampling_engine(model):
    return Engine(model, CFG, SamplingConfig(temperature=0.8, top_p=0.95, top_k=40), eos_ids=(3,))


def _requests(n, seed=0, max_new=(6, 20)):
    rng = np.random.default_rng(seed)
    return [Trajectory(uid=i, group_id=i // 2, prompt=rng.integers(4, 64, size=rng.integers(2, 14)).astype(np.int32),
                       seed=1000 + i, max_new_tokens=int(rng.integers(*max_new))) for i in range(n)]


def _run(engine, trajs):
    sched = Scheduler(engine)
    sched.submit(trajs)
    sched.run()
    assert engine.allocator.num_free == engine.allocator.capacity, "pages leaked"
    return sorted(sched.take_finished(), key=lambda t: t.uid)


def _teacher_forced_logp(logits, traj, temperature):
    logp = jax.nn.log_softmax(logits(list(traj.prompt) + traj.tokens) / temperature, axis=-1)
    p = len(traj.prompt)
    return np.asarray([logp[p + j - 1, tok] for j, tok in enumerate(traj.tokens)])


def _padded_logits(model):
    """Full-recompute logits on sequences right-padded to the context (causal: padding is never seen)."""
    fwd = jax.jit(lambda graphdef, state, x: nnx.merge(graphdef, state)(x), static_argnums=0)
    graphdef, state = nnx.split(model)

    def logits(seq):
        x = np.zeros((1, CFG.max_seq_len), np.int32)
        x[0, : len(seq)] = seq
        return fwd(graphdef, state, x)[0, : len(seq)]
    return logits


def test_greedy_paged_decoding_equals_full_recompute(model, greedy_engine):
    trajs = _run(greedy_engine, _requests(7))  # 7 requests through 4 slots: slots get refilled
    logits = _padded_logits(model)
    for t in trajs:
        seq = list(t.prompt)
        for _ in range(t.max_new_tokens):
            seq.append(int(jnp.argmax(logits(seq)[-1])))
        assert t.tokens == seq[len(t.prompt):], t.uid
        assert t.versions == [0] * t.num_tokens


def test_behaviour_logprobs_equal_teacher_forced(model, sampling_engine):
    trajs = _run(sampling_engine, _requests(6, seed=1))
    logits = _padded_logits(model)
    for t in trajs:
        assert t.finished and (t.tokens[-1] == 3 or t.num_tokens == t.max_new_tokens)
        assert 3 not in t.tokens[:-1]
        np.testing.assert_allclose(t.logps, _teacher_forced_logp(logits, t, 0.8), atol=1e-4)


def test_chunked_resume_prefill_gives_the_verification_logprobs(model, sampling_engine):
    """The resume prefill's log pi, computed 5 positions at a time (never the [rows, T, V] logits), equals the
    teacher-forced log-probs of the response, as the unchunked prefill does."""
    trajs = _run(sampling_engine, _requests(3, seed=5))
    chunked = Engine(model, dataclasses.replace(CFG, logits_chunk=5), sampling_engine.sampling, eos_ids=(3,))
    logits = _padded_logits(model)
    seqs = [np.concatenate([t.prompt, t.tokens]).astype(np.int32) for t in trajs]
    for engine in (sampling_engine, chunked):
        for slot in range(len(trajs)):
            engine.allocator.allocate(slot, len(seqs[slot]))
        response_logp = engine.prefill(seqs, list(range(len(trajs))), [len(t.prompt) for t in trajs])
        for slot in range(len(trajs)):
            engine.allocator.release(slot)
        for i, t in enumerate(trajs):
            np.testing.assert_allclose(np.asarray(response_logp[i, : t.num_tokens]),
                                       _teacher_forced_logp(logits, t, 0.8), atol=1e-4)


def test_sample_does_not_depend_on_slot_or_batch(sampling_engine):
    reqs = _requests(6, seed=2)
    alone = _run(sampling_engine, [reqs[4]])[0]
    crowd = {t.uid: t for t in _run(sampling_engine, _requests(6, seed=2)[::-1])}
    assert crowd[4].tokens == alone.tokens


def test_version_is_recorded_per_token(greedy_engine):
    greedy_engine.set_version(7)
    try:
        t = _run(greedy_engine, _requests(1, seed=3))[0]
        assert t.versions == [7] * t.num_tokens
    finally:
        greedy_engine.set_version(0)


def test_sharded_engine_gives_same_tokens(model, sampling_engine):
    mesh = mesh_lib.make_mesh((2, 2, 2))
    sharded = Engine(model, CFG, SamplingConfig(temperature=0.8, top_p=0.95, top_k=40), eos_ids=(3,), mesh=mesh)
    # The page pool is split: pages over the 4 (data x fsdp) devices with the slots, KV heads over 'tensor'.
    pool = sharded.state.pages.k[0]
    assert pool.sharding.spec == jax.sharding.PartitionSpec("tensor", ("data", "fsdp"), None, None)
    assert pool.addressable_shards[0].data.shape == (1, pool.shape[1] // 4, *pool.shape[2:])
    assert sharded.allocator.num_shards == 4
    assert len(sharded.params["layers"][0]["mlp"]["gate_proj"][...].sharding.device_set) == 8
    a = _run(sampling_engine, _requests(5, seed=4))
    b = _run(sharded, _requests(5, seed=4))
    assert [t.tokens for t in a] == [t.tokens for t in b] and sum(len(t.tokens) for t in b) > 40
    np.testing.assert_allclose(np.concatenate([t.logps for t in a]), np.concatenate([t.logps for t in b]), atol=1e-4)


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=0.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
])
def test_bad_sampling_parameters(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kw)


def test_decode_over_live_pages_equals_decode_over_the_whole_table(model, sampling_engine, monkeypatch):
    """Attention over the page-table columns some slot holds (a bucket: 4, 8 or all 16 pages of 4 tokens) samples
    the same tokens with the same log mu as over all 16 columns."""
    cfg = dataclasses.replace(CFG, page_size=4)
    live_engine = Engine(model, cfg, sampling_engine.sampling, eos_ids=(3,))
    whole = Engine(model, dataclasses.replace(cfg, live_pages=False), sampling_engine.sampling, eos_ids=(3,))
    widths = []
    generate = engine_lib._generate_jit
    monkeypatch.setattr(engine_lib, "_generate_jit", lambda *a: widths.append(a[4]) or generate(*a))
    live = _run(live_engine, _requests(6, seed=9, max_new=(10, 40)))
    full = _run(whole, _requests(6, seed=9, max_new=(10, 40)))
    assert live_engine.live_page_buckets() == [4, 8, 16] and sampling_engine.live_page_buckets() == [8]
    assert {4, 8, 16, None} <= set(widths)  # short and long dispatches; the whole table
    for a, b in zip(live, full, strict=True):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logps, b.logps, atol=1e-5)


def test_shared_prompt_pages_are_copies_of_the_prefilled_ones(model, sampling_engine):
    """A group's members are prefilled once: the others' pages get a copy of its K/V (every cached position, the
    pending last token excluded), equal to prefilling each member itself."""
    prompt = np.arange(4, 4 + 13, dtype=np.int32)  # 12 prefilled tokens over 2 pages of 8
    seqs = [prompt] * 3
    out = []
    for source in ([0, 0, 0], [0, 1, 2]):
        engine = Engine(model, CFG, sampling_engine.sampling, eos_ids=(3,))
        for slot in range(3):
            engine.allocator.allocate(slot, len(prompt) + 4)
        engine.prefill(seqs, [0, 1, 2], [len(prompt)] * 3, with_logp=False, source=source)
        kv = np.asarray(engine.state.pages.k[0])
        out.append([kv[:, engine.allocator.owned[s]].reshape(kv.shape[0], -1, kv.shape[-1])[:, :12] for s in range(3)])
    for shared, own in zip(*out, strict=True):
        np.testing.assert_allclose(shared, own, atol=1e-6)
    assert np.abs(out[0][1]).sum() > 0


def _busy_engine_run(engine, max_new: list[int]) -> tuple[list[Trajectory], list[tuple[list[int], list[int]]]]:
    """Four unrelated requests fill the 4 slots (``max_new`` each: the short ones free their slots after the first
    dispatch, the long ones keep decoding), then a group of two members with one prompt is admitted into the slots
    freed. Returns the finished trajectories (uid order) and each shared admission's (slots, source)."""
    rng = np.random.default_rng(11)
    runners = [Trajectory(uid=i, group_id=i, prompt=rng.integers(4, 64, size=9 + i).astype(np.int32), seed=500 + i,
                          max_new_tokens=m) for i, m in enumerate(max_new)]
    prompt = rng.integers(4, 64, size=13).astype(np.int32)  # 12 prefilled tokens: 2 pages of 8
    group = [Trajectory(uid=4 + j, group_id=9, prompt=prompt, seed=600 + j, max_new_tokens=12) for j in range(2)]
    shared = []
    admit = engine.admit

    def spy(seqs, slots, plens, gen_index, seeds, max_new, source=None):
        if source is not None and any(s != i for i, s in enumerate(source)):
            shared.append((list(slots), list(source)))
        return admit(seqs, slots, plens, gen_index, seeds, max_new, source)
    engine.admit = spy
    try:
        return _run(engine, runners + group), shared
    finally:
        del engine.admit


@pytest.mark.parametrize("max_new, slots", [([24, 2, 24, 2], [1, 3]), ([24, 24, 2, 2], [2, 3])])
def test_a_group_admitted_into_freed_slots_of_a_busy_engine_decodes_as_if_alone(sampling_engine, max_new, slots):
    """A group's members share one prefill of their prompt and get copies of its pages: admitted into slots that are
    not 0..n-1 (non-contiguous ones; ones whose admission index names a running slot) while other sequences decode,
    each member samples exactly what it samples admitted alone, and the running sequences exactly what they sample
    alone (so their caches were not written over)."""
    crowd, shared = _busy_engine_run(sampling_engine, max_new)
    assert shared == [(slots, [0, 0])], "the group should be admitted together into the freed slots"
    for t in crowd:
        alone = Trajectory(uid=t.uid, group_id=t.group_id, prompt=t.prompt, seed=t.seed,
                           max_new_tokens=t.max_new_tokens)
        alone = _run(sampling_engine, [alone])[0]
        assert t.tokens == alone.tokens, t.uid
        np.testing.assert_allclose(t.logps, alone.logps, atol=1e-5)
    assert min(t.num_tokens for t in crowd[4:]) >= 4 and crowd[0].num_tokens > 8  # decoded on after the admission


def test_warmup_runs_a_first_admission_and_activates_nothing(model, sampling_engine):
    """Warmup runs the prefill of a full batch of new prompts, an activation and a decode dispatch, and leaves
    every slot inactive and every page free: a run afterwards samples as on a fresh engine."""
    engine = Engine(model, CFG, sampling_engine.sampling, eos_ids=(3,))
    engine.warmup(prompt_len=5)
    assert not np.asarray(engine.state.active).any()
    assert engine.allocator.num_free == engine.allocator.capacity
    reqs = _requests(4, seed=2)
    fresh = _run(Engine(model, CFG, sampling_engine.sampling, eos_ids=(3,)), _requests(4, seed=2))
    assert [t.tokens for t in _run(engine, reqs)] == [t.tokens for t in fresh]


def test_prefill_program_depends_on_rows_and_width_only(model, sampling_engine):
    """Group sizes, page-copy counts, sequence counts and log-prob or not all run one prefill program per
    (rows, width) bucket: 3 members of a 10-token prompt, 4 members of a 5-token prompt and a resume."""
    engine = Engine(model, CFG, sampling_engine.sampling, eos_ids=(3,))
    _run(engine, _requests(1, seed=0, max_new=(2, 3)))
    before = engine_lib._prefill_jit._cache_size()
    for members, length in ((3, 10), (4, 5)):
        prompt = np.arange(4, 4 + length, dtype=np.int32)
        _run(engine, [Trajectory(uid=u, group_id=members, prompt=prompt, seed=u, max_new_tokens=2)
                      for u in range(members)])
    for slot in range(2):
        engine.allocator.allocate(slot, 12)
    engine.prefill([np.arange(4, 14, dtype=np.int32)] * 2, [0, 1], [5, 5], with_logp=True)
    for slot in range(2):
        engine.allocator.release(slot)
    assert engine_lib._prefill_jit._cache_size() == before


def test_engine_plan_is_the_engines_layout_on_its_own_mesh(model):
    """`EnginePlan.of` (from the model's config: what the deviceless compile has) is what an engine is built from:
    the same graph, static key, decode state and weight layout; each plan is laid out on the mesh it is given."""
    sampling = SamplingConfig(temperature=0.8, top_p=0.95, top_k=40)
    mesh = mesh_lib.make_mesh((2, 2, 2))
    plan = engine_lib.EnginePlan.of(model.cfg, CFG, sampling, mesh, eos_ids=(3, 3), stop_ids=(3, 5),
                                    attention={"pages_per_compute_block": 2})
    assert plan.eos_ids == (3,) and plan.stop_ids == (5,) and plan.static().eos_ids == (3, 5)
    engine = plan.engine(model)
    direct = Engine(model, CFG, sampling, eos_ids=(3, 3), mesh=mesh, attention={"pages_per_compute_block": 2},
                    stop_ids=(3, 5))
    assert direct.plan == plan and direct._static() == plan.static()  # one compiled-program cache key
    assert engine.plan is plan and engine._static() == plan.static()  # from_plan lays nothing out again
    assert engine.plan.graphdef == engine_lib.rollout_graphdef(model)  # the config's graph is the model's
    abstract = plan.abstract_state()
    assert jax.tree.map(lambda a: (a.shape, a.dtype), engine.state) == jax.tree.map(lambda a: (a.shape, a.dtype),
                                                                                    abstract)
    assert engine.state.pages.k[0].sharding == abstract.pages.k[0].sharding
    placed = jax.tree.leaves(engine.params)
    assert [(a.shape, a.sharding) for a in jax.tree.leaves(plan.abstract_params(nnx.state(model)))] == [
        (a.shape, a.sharding) for a in placed]
    one = engine_lib.EnginePlan.of(model.cfg, CFG, sampling, mesh_lib.make_mesh((1, 1, 1), devices=jax.devices()[:1]))
    assert one.layout.num_shards == 1 and plan.layout.num_shards == 4 and one.eos_ids == (-1,)


def test_static_argument_is_built_once_per_sampler(model, monkeypatch):
    """Every dispatch hands jit the same ``EngineStatic`` object, whose hash (a walk over the model's whole GraphDef,
    1.6 ms at 36 layers) is computed once; an evaluation's sampler gets its own, and the training sampler's object
    comes back after it. Equal statics of two engines still share compiled programs."""
    engine = Engine(model, CFG, SamplingConfig(greedy=True))
    first = engine._static()
    assert engine._static() is first and engine.static is first
    seen = []
    real = engine_lib._generate_jit
    monkeypatch.setattr(engine_lib, "_generate_jit", lambda static, *a: seen.append(static) or real(static, *a))
    graph_hashes = []
    graph_hash = type(first.graphdef).__hash__
    monkeypatch.setattr(type(first.graphdef), "__hash__", lambda g: graph_hashes.append(1) or graph_hash(g))
    engine.generate()
    engine.generate()
    assert seen[0] is first and seen[1] is first and len(graph_hashes) <= 1  # hashed at most once, ever
    evaluation = SamplingConfig(temperature=0.6)
    engine.sampling = evaluation
    own = engine._static()
    assert own is not first and own.sampling == evaluation and engine._static() is own
    engine.sampling = SamplingConfig(greedy=True)  # an equal config, another object: the same static
    assert engine._static() is first
    assert first == engine_lib.EnginePlan.static(engine.plan) and hash(first) == hash(engine.plan.static())


def test_decode_stop_finished_returns_early_and_samples_the_same_tokens(model, sampling_engine):
    """EngineConfig.decode_stop_finished: a dispatch returns after the step at which that many of its slots finished
    (a while_loop); its outputs keep their [steps, slots] shape, the steps not run emitting nothing, and every
    request samples the tokens the fixed-length loop samples (log mu to float32 rounding). ~One decode compile."""
    early = Engine(model, dataclasses.replace(CFG, decode_stop_finished=1), sampling_engine.sampling, eos_ids=(3,))
    outputs = []
    dispatch = early.dispatch_generate

    def capture():
        pending = dispatch()
        outputs.append(pending)
        return pending
    early.dispatch_generate = capture
    runs = {}
    for name, engine in (("plain", sampling_engine), ("early", early)):
        sched = Scheduler(engine)
        sched.submit(_requests(6, seed=5, max_new=(3, 20)))
        sched.run()
        runs[name] = (sorted(sched.take_finished(), key=lambda t: t.uid), sched.stats)
    (plain, plain_stats), (got, stats) = runs["plain"], runs["early"]
    assert [t.tokens for t in got] == [t.tokens for t in plain]
    for t, ref in zip(got, plain, strict=True):  # log mu to float32 rounding (other batches, another loop's fusion)
        np.testing.assert_allclose(t.logps, ref.logps, rtol=1e-5, atol=1e-6)
    assert plain_stats.decode_steps == plain_stats.dispatches * CFG.steps_per_dispatch
    assert stats.decode_steps < stats.dispatches * CFG.steps_per_dispatch  # some dispatch stopped early
    for pending in outputs:
        tokens, logps, emitted = pending.fetch()
        assert tokens.shape == emitted.shape == (CFG.steps_per_dispatch, CFG.num_slots)
        ran = emitted.any(axis=1)
        assert not (~ran[:-1] & ran[1:]).any()  # the steps run are a prefix; the rest emit nothing
        assert (tokens[~ran] == 0).all() and (logps[~ran] == 0).all()
    with pytest.raises(ValueError, match="decode_stop_finished"):
        dataclasses.replace(CFG, decode_stop_finished=-1)


def test_page_table_sync_leaves_the_decode_state_alone(greedy_engine):
    """``sync_page_table`` puts the host table on the device without passing the decode state (its KV pages, two
    arrays a layer: 0.2 ms of host time a dispatch at 36 layers) through a call: the pages are the same arrays."""
    pages = greedy_engine.state.pages.k[0]
    greedy_engine.sync_page_table()
    assert greedy_engine.state.pages.k[0] is pages and not pages.is_deleted()
    np.testing.assert_array_equal(np.asarray(greedy_engine.state.page_table), greedy_engine.allocator.table)
    assert greedy_engine.state.page_table.sharding == jax.sharding.NamedSharding(greedy_engine.mesh,
                                                                                 greedy_engine.layout.slots_spec(2))
