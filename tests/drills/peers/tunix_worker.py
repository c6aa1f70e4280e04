"""bench_peers.py's worker for Google Tunix (runs in Tunix's own environment): its Qwen3 model loaded from the
same safetensors and its ``Sampler`` (static batches of ``slots`` prompts, left padded to a fixed prompt width,
decoding until every row of the batch has hit EOS or the step budget).

Known Tunix bugs that bear on a fair comparison: its Qwen3 ignores ``rope_theta`` (always 1e6; the tiny policy
uses 1e6, so it is unaffected), and its packed RL attention applies no mask off TPU, so only its padded learner
path is compared."""

from __future__ import annotations

import json
import os
import time

import protocol

protocol.claim_stdout()


class IdTokenizer:
    """Prompts cross the protocol as token ids; the sampler's string interface gets them as '3 17 5'."""

    def __init__(self, eos_id: int, pad_id: int):
        self._eos, self._pad = eos_id, pad_id

    def encode(self, text: str, **_) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, **_) -> str:
        return " ".join(str(int(t)) for t in ids)

    def bos_id(self):
        return None

    def eos_id(self) -> int:
        return self._eos

    def pad_id(self) -> int:
        return self._pad


def _model_config(policy: str):
    from tunix.models.qwen3 import model as model_lib

    c = json.load(open(os.path.join(policy, "config.json")))
    theta = c.get("rope_theta") or c.get("rope_parameters", {}).get("rope_theta", 1e6)
    return model_lib.ModelConfig(
        num_layers=c["num_hidden_layers"], vocab_size=c["vocab_size"], embed_dim=c["hidden_size"],
        hidden_dim=c["intermediate_size"], num_heads=c["num_attention_heads"], head_dim=c["head_dim"],
        num_kv_heads=c["num_key_value_heads"], rope_theta=int(theta), norm_eps=c["rms_norm_eps"],
        use_tied_embedding=c.get("tie_word_embeddings", False))


class Worker:
    def setup(self, policy: str, configs: list[dict] | None = None, max_seq_len: int = 0,
              prompt_width: int = 128, max_new: int = 200, **_) -> dict:
        import importlib.metadata

        import jax
        import jax.numpy as jnp
        from tunix.generate import sampler as sampler_lib
        from tunix.models.qwen3 import params as params_lib

        t0 = time.perf_counter()
        if os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # same persistent-cache settings as the project's
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        self.cfg = _model_config(policy)
        self.model = params_lib.create_model_from_safe_tensors(policy, self.cfg, dtype=jnp.float32)
        gen = json.load(open(os.path.join(policy, "generation_config.json")))
        eos = gen["eos_token_id"]
        self.eos_ids = eos if isinstance(eos, list) else [eos]
        self.pad_id = gen.get("pad_token_id", self.eos_ids[0])
        self.prompt_width = prompt_width
        cache = sampler_lib.CacheConfig(cache_size=prompt_width + max_new, num_layers=self.cfg.num_layers,
                                        num_kv_heads=self.cfg.num_kv_heads, head_dim=self.cfg.head_dim)
        self.sampler = sampler_lib.Sampler(self.model, IdTokenizer(self.eos_ids[0], self.pad_id), cache)
        return {"seconds": time.perf_counter() - t0, "version": importlib.metadata.version("google-tunix"),
                "jax": jax.__version__, "flax": importlib.metadata.version("flax")}

    def generate(self, prompts: list[list[int]], slots: int, eos: bool, max_new: int, seed: int,
                 greedy: bool = False, return_tokens: bool = False) -> dict:
        responses = []
        # EOS off: a stop id no token has (the vocabulary is smaller), so every row runs max_new steps
        stop = self.eos_ids if eos else [10**6]
        t0 = time.perf_counter()
        for b in range(0, len(prompts), slots):
            chunk = prompts[b: b + slots]
            kwargs = {} if greedy else {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
            out = self.sampler([" ".join(map(str, p)) for p in chunk], max_generation_steps=max_new,
                               max_prompt_length=self.prompt_width, eos_tokens=stop, seed=seed * 100_003 + b,
                               **kwargs)
            for row in out.tokens:
                resp = [int(t) for t in row]
                if eos and len(resp) < max_new:  # the sampler cuts the EOS off; it was generated
                    resp.append(self.eos_ids[0])
                responses.append(resp)
        return protocol.generation_result(time.perf_counter() - t0, responses, max_new, eos, return_tokens)

    def first_tokens(self, prompts: list[list[int]], slots: int, eos: bool) -> dict:
        return self.generate(prompts[:slots], slots, eos, max_new=1, seed=0)

    def logits(self, prompts: list[list[int]]) -> dict:
        import jax.numpy as jnp
        import numpy as np

        out = []
        for p in prompts:
            n = len(p)
            tokens = jnp.asarray([p], jnp.int32)
            positions = jnp.arange(n, dtype=jnp.int32)[None]
            mask = jnp.tril(jnp.ones((n, n), bool))[None]
            logits, _ = self.model(tokens, positions, None, mask)
            out.append(np.asarray(logits[0], np.float64).tolist())
        return {"logits": out}

    def grpo_setup(self, rows: dict, **_) -> dict:
        """One update of Tunix's GRPO learner on padded rows: its registered ``grpo`` policy loss (GRPOConfig with
        beta = 0, no reference model, token-mean aggregation) under ``nnx.value_and_grad`` and an ``nnx.Optimizer``
        in one ``nnx.jit``, as its trainer's ``_train_step`` runs it."""
        import flax.nnx as nnx
        import jax
        import jax.numpy as jnp
        import numpy as np
        import optax
        from tunix.rl import algo_core
        from tunix.rl.grpo import grpo_learner

        algo = grpo_learner.GRPOConfig(num_generations=rows["group_size"], beta=0.0, epsilon=0.2,
                                       loss_agg_mode="token-mean")
        if not hasattr(algo, "temperature"):  # its learner copies the rollout temperature in; T = 1 here
            object.__setattr__(algo, "temperature", 1.0)
        prompts, responses = rows["prompts"], rows["responses"]
        pw = max(len(p) for p in prompts)
        cw = max(len(r) for r in responses)
        n = len(prompts)
        prompt_ids = np.full((n, pw), self.pad_id, np.int32)
        completion_ids = np.full((n, cw), self.pad_id, np.int32)
        old = np.zeros((n, cw), np.float32)
        for i, (p, r, lp) in enumerate(zip(prompts, responses, rows["logps"], strict=True)):
            prompt_ids[i, pw - len(p):] = p  # prompts left padded, completions right padded
            completion_ids[i, : len(r)] = r
            old[i, : len(lp)] = lp
        example = grpo_learner.TrainExample(
            prompt_ids=jnp.asarray(prompt_ids), prompt_mask=jnp.asarray(prompt_ids != self.pad_id),
            completion_ids=jnp.asarray(completion_ids),
            completion_mask=jnp.asarray(np.arange(cw)[None] < np.asarray([len(r) for r in responses])[:, None]),
            advantages=jnp.asarray(rows["advantages"], jnp.float32), ref_per_token_logps=None,
            old_per_token_logps=jnp.asarray(old))
        optimizer = nnx.Optimizer(self.model, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-6)),
                                  wrt=nnx.Param)
        pad_id, eos_id = self.pad_id, self.eos_ids[0]

        def loss_fn(model, example):
            return algo_core.grpo_loss_fn(model, example, algo, pad_id, eos_id)

        @nnx.jit
        def step(model, optimizer, example):
            (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, example)
            optimizer.update(model, grads)
            return loss

        self._grpo = lambda: jax.block_until_ready(step(self.model, optimizer, example))
        seconds = self.grpo()["seconds"] + self.grpo()["seconds"]  # compile (the second call compiles again)
        return {"compile_s": round(seconds, 2), "shape": [n, pw + cw]}

    def grpo(self, **_) -> dict:
        t0 = time.perf_counter()
        self._grpo()
        return {"seconds": time.perf_counter() - t0}


if __name__ == "__main__":
    w = Worker()
    protocol.serve({"setup": w.setup, "generate": w.generate, "first_tokens": w.first_tokens, "logits": w.logits,
                    "grpo_setup": w.grpo_setup, "grpo": w.grpo})
