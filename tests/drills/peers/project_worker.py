"""bench_peers.py's worker for this project: the rollout engine through its public API (as bench_decode.py uses
it). Commands: setup, greedy, logits, generate, grpo_setup, grpo (see bench_peers.py)."""

from __future__ import annotations

import time

import protocol

protocol.claim_stdout()  # before JAX is imported: nothing but replies on stdout


class Worker:
    def __init__(self):
        self.engines = {}
        self.model = None

    def setup(self, policy: str, configs: list[dict], max_seq_len: int, page_size: int = 16,
              steps_per_dispatch: int = 8, **_) -> dict:
        """Loads the policy and builds one engine per (slots, eos) workload configuration. Nothing is compiled here:
        each shape compiles when first used (bench_peers.py's warm-up round runs every workload once)."""
        import jax

        from rollverify_jax.infra import compile_cache
        from rollverify_jax.models import load_pretrained
        from rollverify_jax.models.tokenizer import Tokenizer
        from rollverify_jax.rollout import Engine, EngineConfig, SamplingConfig

        t0 = time.perf_counter()
        cache = compile_cache.compilation_cache()  # what the CLIs do at start (ROLLVERIFY_COMPILATION_CACHE)
        self.model = load_pretrained(policy)
        self.eos_ids = tuple(Tokenizer.from_dir(policy).eos_ids)
        for c in configs:
            cfg = EngineConfig(num_slots=c["slots"], page_size=page_size, max_seq_len=max_seq_len,
                               steps_per_dispatch=steps_per_dispatch)
            sampling = SamplingConfig(greedy=True) if c.get("greedy") else SamplingConfig(temperature=1.0)
            engine = Engine(self.model, cfg, sampling, eos_ids=self.eos_ids if c["eos"] else ())
            self.engines[(c["slots"], c["eos"], bool(c.get("greedy")))] = engine
        return {"seconds": time.perf_counter() - t0, "version": _version(), "jax": jax.__version__,
                "cache": cache, "eos_ids": list(self.eos_ids)}

    def generate(self, prompts: list[list[int]], slots: int, eos: bool, max_new: int, seed: int,
                 greedy: bool = False, return_tokens: bool = False) -> dict:
        """Every prompt to EOS or ``max_new`` tokens through the scheduler (continuous batching over ``slots``)."""
        import numpy as np

        from rollverify_jax.rollout import Scheduler, Trajectory

        engine = self.engines[(slots, eos, greedy)]
        reqs = [Trajectory(uid=i, group_id=i, prompt=np.asarray(p, np.int32), seed=seed * 100_003 + i,
                           max_new_tokens=max_new) for i, p in enumerate(prompts)]
        sched = Scheduler(engine)
        t0 = time.perf_counter()
        sched.submit(reqs)
        sched.run()
        finished = sched.take_finished()
        seconds = time.perf_counter() - t0
        if len(finished) != len(reqs):
            raise RuntimeError(f"{len(finished)} of {len(reqs)} requests finished")
        finished.sort(key=lambda t: t.uid)
        out = {"seconds": seconds, "tokens": sum(t.num_tokens for t in finished),
               "lengths": [t.num_tokens for t in finished]}
        if return_tokens:
            out["responses"] = [list(map(int, t.tokens)) for t in finished]
            out["logps"] = [list(map(float, t.logps)) for t in finished]
        return out

    def first_tokens(self, prompts: list[list[int]], slots: int, eos: bool) -> dict:
        """The first generated token of each prompt (one admission: prefill + insert)."""
        return self.generate(prompts[:slots], slots, eos, max_new=1, seed=0)

    def logits(self, prompts: list[list[int]]) -> dict:
        """Full-sequence logits of each prompt (a plain forward pass of the model, one prompt at a time)."""
        import jax.numpy as jnp
        import numpy as np

        return {"logits": [np.asarray(self.model(jnp.asarray([p], jnp.int32))[0], np.float64).tolist()
                           for p in prompts]}

    def grpo_setup(self, rows: dict, width: int = 320) -> dict:
        """Builds the learner (``Learner.create``: the run's train step); the batch is ``build_batch`` over the given
        rows, packed as the run packs it."""
        import jax
        import numpy as np

        from rollverify_jax.infra import mesh as mesh_lib
        from rollverify_jax.rl import learner, packing
        from rollverify_jax.rl.batch import build_batch
        from rollverify_jax.rollout import Trajectory

        mesh = mesh_lib.make_mesh((1, 1, 1), devices=jax.devices()[:1])
        cfg = learner.LearnerConfig()
        self.learner = learner.Learner.create(self.model, cfg, learner.OptimizerConfig(learning_rate=1e-6), mesh)
        self.train_state = self.learner.init_state(self.model, seed=0)
        trajs = [Trajectory(uid=i, group_id=i // rows["group_size"], prompt=np.asarray(p, np.int32), seed=0,
                            max_new_tokens=len(r), tokens=list(r), logps=list(lp))
                 for i, (p, r, lp) in enumerate(zip(rows["prompts"], rows["responses"], rows["logps"], strict=True))]
        advantages = np.asarray(rows["advantages"], np.float32)
        self.grpo_batch = packing.pack_for_learner(build_batch(trajs, advantages, max_len=width), cfg, mesh)
        seconds = self.grpo()["seconds"] + self.grpo()["seconds"]  # compile, then one warm call
        return {"compile_s": round(seconds, 2), "shape": list(self.grpo_batch["packed_tokens"].shape)}

    def grpo(self) -> dict:
        import jax

        t0 = time.perf_counter()
        self.train_state, metrics = self.learner.train_step(self.train_state, self.grpo_batch)
        jax.block_until_ready(metrics)
        return {"seconds": time.perf_counter() - t0}


def _version() -> str:
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "rollverify_jax"], capture_output=True, text=True,
                               check=True).stdout.strip()
        return f"{head} + uncommitted changes to rollverify_jax/" if dirty else head
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    w = Worker()
    protocol.serve({"setup": w.setup, "generate": w.generate, "first_tokens": w.first_tokens, "logits": w.logits,
                    "grpo_setup": w.grpo_setup, "grpo": w.grpo})
