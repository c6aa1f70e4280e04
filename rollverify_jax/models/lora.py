"""LoRA adapters on the Qwen3 policy, applied with qwix: ``W x`` becomes ``W x + (alpha / rank) B A x``.

qwix intercepts the einsums of the modules whose path matches ``LoraConfig.target_modules`` (``models.qwen3.dense``)
and adds one ``nnx.LoRAParam`` pair per weight: ``A`` [in, rank] (He-uniform) and ``B`` [rank, out] (zeros, so an
adapted model starts equal to its base). The base ``nnx.Param``s are untouched: training takes its gradient with
respect to the ``LoRAParam``s only (``trainable_filter``) and the base is held once, frozen, by the learner, the
reference pass and the engine. MoE experts run through ``ragged_dot``, which qwix does not adapt: in a MoE model
the attention projections (and any dense MLP layer) carry the adapters, the experts and the router stay frozen.

The rollout engine runs the adapters in its forward instead of merging ``W + BA`` into a serving copy: the same
einsums as the learner's, so the engine's log-probs are the learner's on the adapted model (a merged weight rounds
differently), no second copy of the base is held, and a publish moves the adapters alone
(``scripts/bench_lora.py`` measures both ways).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx
from safetensors.numpy import save_file

from rollverify_jax.infra import distributed
from rollverify_jax.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

LORA_A, LORA_B = "_lora_a", "_lora_b"  # qwix's suffixes of the two adapter params beside a weight


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters instead of full fine-tuning (rank 0: off, every parameter trains).

    rank: the adapters' inner dimension r; alpha: their scale is ``alpha / rank`` (PEFT's ``lora_alpha``).
    target_modules: a regular expression that must match a module's whole path (``layers/3/self_attn``,
        ``layers/3/mlp``); every projection weight of a matching module gets an adapter pair. The default adapts
        every linear layer of every decoder layer (q, k, v, o, gate, up, down), as Tunix and "LoRA without regret"
        recommend for RL. Embeddings, norms, the LM head and MoE experts never get one.
    seed: the adapters' initialisation (``A``; ``B`` starts at zero).
    No dropout: the learner's log pi of the sampled tokens must equal the engine's log mu at the same weights (the
    on-policy ratio is 1 and the OPS of a fresh token 0); a dropped-out forward breaks both.
    """

    rank: int = 0
    alpha: float = 16.0
    target_modules: str = r"layers/\d+/(self_attn|mlp)"
    seed: int = 0

    def __post_init__(self):
        if self.rank < 0:
            raise ValueError(f"LoraConfig.rank={self.rank} must be >= 0 (0: full fine-tuning).")
        if self.rank and not self.alpha > 0:
            raise ValueError(f"LoraConfig.alpha={self.alpha} must be > 0.")
        try:
            re.compile(self.target_modules)
        except re.error as e:
            raise ValueError(f"LoraConfig.target_modules={self.target_modules!r} is not a regular expression: "
                             f"{e}.") from None

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _provider(cfg: LoraConfig) -> qwix.LoraProvider:
    # Only the einsums of `qwen3.dense` are adapted: the router's matmul and the experts' ragged_dot are not einsums,
    # and the attention's own einsums take activations, not weights, on their right (qwix skips those).
    return qwix.LoraProvider([qwix.LoraRule(module_path=cfg.target_modules, rank=cfg.rank, alpha=cfg.alpha,
                                            op_names=("einsum",))])


def _add_adapters(model: nnx.Module, cfg: LoraConfig) -> None:
    """Adds an adapter pair beside each weight a matching module applies with ``qwen3.dense`` (its
    ``DENSE_WEIGHTS``), in the shapes qwix's einsum interception takes for ``...i,io->...o``: ``A`` [in, rank],
    ``B`` [rank, out], each with its weight's side of the logical axes (the rank dimension replicated), so adapters
    are sharded like the weight they adapt. The values are placeholders: ``adapt`` draws them.

    qwix would create the same pairs itself in one traced forward, but reads each weight's sharding on the way,
    which on a tracer costs a walk over every equation traced so far: 5 minutes for Qwen3-0.6B, more for 8B
    (tests/test_lora.py checks that both ways give the same structure)."""
    for path, module in nnx.iter_modules(model):
        if not re.fullmatch(cfg.target_modules, "/".join(map(str, path))):
            continue
        for weight in getattr(type(module), "DENSE_WEIGHTS", ()):
            var = getattr(module, weight)
            (fan_in, fan_out), dtype = var.shape, var.dtype
            axes = var.get_metadata()["logical_axes"]
            setattr(module, weight + LORA_A, nnx.LoRAParam(jax.ShapeDtypeStruct((fan_in, cfg.rank), dtype),
                                                           logical_axes=(axes[0], None)))
            setattr(module, weight + LORA_B, nnx.LoRAParam(jax.ShapeDtypeStruct((cfg.rank, fan_out), dtype),
                                                           logical_axes=(None, axes[1])))


@functools.cache
def _adapted_structure(model_cfg: Qwen3Config, cfg: LoraConfig) -> Qwen3ForCausalLM:
    """An abstract (shape-only) adapted model of ``model_cfg``: qwix's intercepted model (its ``hidden_states``
    applies the adapters of every matching module) with the adapter pairs in place."""
    base = nnx.eval_shape(lambda: Qwen3ForCausalLM(model_cfg, rngs=nnx.Rngs(0)))
    model = qwix.apply_lora_to_model(base, _provider(cfg), skip_nnx_init=True, methods=("hidden_states",),
                                     rngs=nnx.Rngs(cfg.seed))
    _add_adapters(model, cfg)
    model.lora_config = cfg  # static: what `structure` rebuilds the adapted graph from
    if not adapted_weights(model):
        raise ValueError(f"LoraConfig.target_modules={cfg.target_modules!r} matches no module with a projection "
                         r"weight; module paths look like 'layers/0/self_attn' or 'layers/0/mlp' (default "
                         r"'layers/\d+/(self_attn|mlp)').")
    return model


def lora_config_of(model: nnx.Module) -> LoraConfig | None:
    """The adapters' config of an adapted model (None: a plain model)."""
    return getattr(model, "lora_config", None)


def structure(model_cfg: Qwen3Config, cfg: LoraConfig | None = None) -> Qwen3ForCausalLM:
    """An abstract model of ``model_cfg``, adapted by ``cfg`` when it is enabled (nothing is allocated)."""
    if cfg is None or not cfg.enabled:
        return nnx.eval_shape(lambda: Qwen3ForCausalLM(model_cfg, rngs=nnx.Rngs(0)))
    return _adapted_structure(model_cfg, cfg)


def adapted_weights(model: nnx.Module) -> list[tuple]:
    """Paths of the weights that carry an adapter pair (``('layers', 0, 'self_attn', 'q_proj')``, ...)."""
    out = []
    for path, module in nnx.iter_modules(model):
        out.extend((*path, name[: -len(LORA_A)]) for name in vars(module) if name.endswith(LORA_A))
    return sorted(out, key=str)


def adapt(model: Qwen3ForCausalLM, cfg: LoraConfig) -> Qwen3ForCausalLM:
    """``model`` (concrete) with fresh adapters: its own weights (not copied) and, per adapted weight, ``A`` drawn
    He-uniform from ``cfg.seed`` and ``B`` zero, both placed like the weight they adapt. A disabled ``cfg`` returns
    ``model`` unchanged."""
    if not cfg.enabled:
        return model
    graphdef, abstract_adapters, _ = nnx.split(_adapted_structure(model.cfg, cfg), nnx.LoRAParam, ...)
    flat = nnx.to_flat_state(abstract_adapters)
    weights = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    key, init_a = jax.random.key(cfg.seed), jax.nn.initializers.he_uniform()
    values = []
    for i, (path, var) in enumerate(flat):
        weight = weights[(*path[:-1], path[-1][: -len(LORA_A)])].get_value()
        shape, dtype = var.get_value().shape, var.get_value().dtype
        if path[-1].endswith(LORA_A):
            value = init_a(jax.random.fold_in(key, i), shape, jnp.float32).astype(dtype)
        else:
            value = jnp.zeros(shape, dtype)
        sharding = getattr(weight, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):  # the weight's side; the rank dimension replicated
            spec = tuple(sharding.spec) + (None,) * (2 - len(sharding.spec))
            side = (spec[0], None) if path[-1].endswith(LORA_A) else (None, spec[1])
            value = jax.device_put(value, sharding.update(spec=jax.sharding.PartitionSpec(*side)))
        values.append((path, var.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(values), nnx.state(model, nnx.Param))


def trainable_filter(model: nnx.Module):
    """What training updates: the adapters of an adapted model, every ``nnx.Param`` of a plain one."""
    return nnx.LoRAParam if lora_config_of(model) is not None else nnx.Param


def split_trainable(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """``(graphdef, trainable, frozen)``: the frozen part is the base weights of an adapted model (empty for a
    plain one); ``nnx.merge(graphdef, trainable, frozen)`` rebuilds the model."""
    if lora_config_of(model) is None:
        graphdef, params = nnx.split(model, nnx.Param)
        return graphdef, params, nnx.State({})
    return nnx.split(model, nnx.LoRAParam, nnx.Param)


def merged_weights(model: nnx.Module) -> nnx.State:
    """The base params of an adapted model with each adapter folded in, ``W + (alpha / rank) A B`` (computed in
    float32, stored in ``W``'s dtype): the params of a plain model of the same config (export)."""
    cfg = lora_config_of(model)
    base = dict(nnx.to_flat_state(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))))
    if cfg is None:
        return nnx.from_flat_state(list(base.items()))
    adapters = dict(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))
    for path in adapted_weights(model):
        var = base[path]
        a = adapters[(*path[:-1], path[-1] + LORA_A)].get_value().astype(jnp.float32)
        b = adapters[(*path[:-1], path[-1] + LORA_B)].get_value().astype(jnp.float32)
        w = var.get_value()
        base[path] = var.replace((w.astype(jnp.float32) + cfg.scale * (a @ b)).astype(w.dtype))
    return nnx.from_flat_state(list(base.items()))


def merged_model(model: Qwen3ForCausalLM) -> Qwen3ForCausalLM:
    """A plain model whose weights are ``merged_weights(model)`` (what HF transformers loads without PEFT)."""
    plain = nnx.split(structure(model.cfg))[0]
    return nnx.merge(plain, merged_weights(model))


# ---------------------------------------------------------------------------------------------------------
# PEFT format: adapter_config.json + adapter_model.safetensors, loadable with peft onto the HF base.


def _hf_module(path: tuple) -> str:
    """('layers', 3, 'self_attn', 'q_proj') -> 'model.layers.3.self_attn.q_proj' (HF Qwen3's module names)."""
    return "model." + ".".join(str(p) for p in path)


def peft_tensors(model: nnx.Module) -> dict[str, np.ndarray]:
    """The adapters under PEFT's names and layout (``torch.nn.Linear``: weight [out, in]): ``lora_A.weight`` =
    A^T [rank, in], ``lora_B.weight`` = B^T [out, rank]."""
    adapters = dict(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))
    out = {}
    for path in adapted_weights(model):
        name = "base_model.model." + _hf_module(path)
        for suffix, peft in ((LORA_A, "lora_A"), (LORA_B, "lora_B")):
            value = distributed.fetch(adapters[(*path[:-1], path[-1] + suffix)].get_value())  # whole, every process
            out[f"{name}.{peft}.weight"] = np.ascontiguousarray(np.asarray(value).T)
    return out


def peft_config(model: nnx.Module, base_model: str | None) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` for ``model``'s adapters. ``target_modules`` names every adapted module
    exactly (a full-match regular expression), so PEFT adapts the same weights and no other."""
    cfg = lora_config_of(model)
    if cfg is None:
        raise ValueError("the model has no LoRA adapters (LoraConfig.rank = 0): export the full weights instead.")
    names = "|".join(re.escape(_hf_module(p)) for p in adapted_weights(model))
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": cfg.rank,
            "lora_alpha": cfg.alpha, "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False,
            "fan_in_fan_out": False, "init_lora_weights": True, "target_modules": f"({names})",
            "inference_mode": True}


def save_peft_adapter(model: nnx.Module, path: str | os.PathLike, base_model: str | None = None) -> None:
    """Writes ``adapter_config.json`` and ``adapter_model.safetensors`` into the directory ``path``:
    ``peft.PeftModel.from_pretrained(<the HF base>, path)`` then runs the adapted model. ``base_model``: the
    base's path or hub id, recorded in the config (PEFT's ``base_model_name_or_path``)."""
    path = Path(path)
    config, tensors = peft_config(model, base_model), peft_tensors(model)  # every process joins the gathers
    if not distributed.is_main_process():
        return
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
