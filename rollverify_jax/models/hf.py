"""HF-layout import/export for Qwen3 / Qwen3-MoE: ``config.json`` + safetensors (single or sharded).

Each tensor is read slice by slice with ``jax.make_array_from_callback``, so every device receives only
the shard its mesh sharding asks for; a host never materialises a full checkpoint.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from rollverify_jax.infra import distributed
from rollverify_jax.infra import mesh as mesh_lib
from rollverify_jax.models import lora
from rollverify_jax.models.qwen3 import Qwen3Config, Qwen3ForCausalLM, resolve_dtype

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


# ----------------------------------------------------------------------------------------------------
# config.json


def config_from_hf(raw: dict, dtype: str | None = None, compute_dtype: str | None = None) -> Qwen3Config:
    """Parses a transformers v4 (top-level ``rope_theta``, ``torch_dtype``) or v5 (``rope_parameters``,
    ``dtype``) Qwen3 / Qwen3-MoE config."""
    archs = raw.get("architectures") or []
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"Unsupported architectures {archs!r} in config.json; supported: {list(SUPPORTED_ARCHITECTURES)}."
        )
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"Unsupported rope_type {rope_type!r}; only the default RoPE is implemented.")
    rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    ckpt_dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    param_dtype = dtype or _TORCH_DTYPES.get(str(ckpt_dtype), "float32")
    is_moe = archs[0] == "Qwen3MoeForCausalLM"
    num_experts = raw.get("num_experts", raw.get("num_local_experts", 0)) if is_moe else 0
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    return Qwen3Config(
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads", heads),
        head_dim=raw.get("head_dim") or hidden // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        max_position_embeddings=raw.get("max_position_embeddings", 40960),
        num_experts=num_experts or 0,
        num_experts_per_tok=raw.get("num_experts_per_tok", 0) if num_experts else 0,
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        moe_intermediate_size=raw.get("moe_intermediate_size", 0) if num_experts else 0,
        decoder_sparse_step=raw.get("decoder_sparse_step", 1) or 1,
        mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
        param_dtype=param_dtype,
        dtype=compute_dtype or param_dtype,
    )


def config_to_hf(cfg: Qwen3Config) -> dict:
    """The v5 layout, with the v4 keys too so either transformers major reads it."""
    moe = cfg.num_experts > 0
    raw = {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if moe else "qwen3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "max_position_embeddings": cfg.max_position_embeddings,
        "dtype": cfg.param_dtype,
        "torch_dtype": cfg.param_dtype,
    }
    if moe:
        raw.update(
            num_experts=cfg.num_experts, num_local_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
            moe_intermediate_size=cfg.moe_intermediate_size, decoder_sparse_step=cfg.decoder_sparse_step,
            mlp_only_layers=list(cfg.mlp_only_layers),
        )
    return raw


# ----------------------------------------------------------------------------------------------------
# Name mapping: our parameter path <-> HF tensors.

Index = tuple[slice, ...]


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """How one of our parameters is stored in HF layout.

    kind 'plain': same layout; 'linear': HF [out, in] vs our kernel [in, out];
    'experts': our [E, in, out] is E per-expert HF Linear weights ``names[e]`` [out, in].
    """

    kind: str
    names: tuple[str, ...]

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        if self.kind == "linear":
            return (ours[1], ours[0])
        if self.kind == "experts":
            return (ours[2], ours[1])
        return ours

    def read(self, get: Callable[[str, Index], np.ndarray], idx: Index) -> np.ndarray:
        """Our-layout data at ``idx``, read slice-wise from the checkpoint."""
        if self.kind == "linear":
            return get(self.names[0], (idx[1], idx[0])).T
        if self.kind == "experts":
            return np.stack([get(self.names[e], (idx[2], idx[1])).T for e in range(len(self.names))[idx[0]]])
        return get(self.names[0], idx)

    def write(self, value: np.ndarray):
        """Yields (HF name, HF-layout array) for our full parameter value."""
        if self.kind == "linear":
            yield self.names[0], np.ascontiguousarray(value.T)
        elif self.kind == "experts":
            for e, name in enumerate(self.names):
                yield name, np.ascontiguousarray(value[e].T)
        else:
            yield self.names[0], value


def hf_tensor_map(cfg: Qwen3Config) -> dict[tuple, HFTensor]:
    """Our flat parameter path -> its HF tensors."""
    def plain(n):
        return HFTensor("plain", (n,))

    def linear(n):
        return HFTensor("linear", (n,))

    out = {("embed_tokens",): plain("model.embed_tokens.weight"), ("norm", "weight"): plain("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = linear("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        p, layer = f"model.layers.{i}", ("layers", i)
        out[layer + ("input_layernorm", "weight")] = plain(f"{p}.input_layernorm.weight")
        out[layer + ("post_attention_layernorm", "weight")] = plain(f"{p}.post_attention_layernorm.weight")
        for proj in ("q", "k", "v", "o"):
            out[layer + ("self_attn", f"{proj}_proj")] = linear(f"{p}.self_attn.{proj}_proj.weight")
        if cfg.attention_bias:
            for proj in ("q", "k", "v"):
                out[layer + ("self_attn", f"{proj}_bias")] = plain(f"{p}.self_attn.{proj}_proj.bias")
        for norm in ("q_norm", "k_norm"):
            out[layer + ("self_attn", norm, "weight")] = plain(f"{p}.self_attn.{norm}.weight")
        if cfg.is_sparse_layer(i):
            out[layer + ("mlp", "router")] = linear(f"{p}.mlp.gate.weight")
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names = tuple(f"{p}.mlp.experts.{e}.{proj}.weight" for e in range(cfg.num_experts))
                out[layer + ("mlp", proj)] = HFTensor("experts", names)
        else:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                out[layer + ("mlp", proj)] = linear(f"{p}.mlp.{proj}.weight")
    return out


# ----------------------------------------------------------------------------------------------------
# Reading


class _SafetensorsDir:
    """Lazy access to every tensor of a checkpoint directory (one file or shards with an index)."""

    def __init__(self, path: Path):
        index = path / _INDEX
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (path / _SINGLE).exists():
            files = [_SINGLE]
            weight_map = None
        else:
            raise FileNotFoundError(f"No {_SINGLE} or {_INDEX} in {path}; expected HF safetensors weights.")
        self._handles = {}
        for f in files:
            if not (path / f).exists():
                raise FileNotFoundError(f"Shard {path / f} listed in {index} is missing.")
            self._handles[f] = safe_open(str(path / f), framework="numpy")
        if weight_map is None:
            weight_map = {k: _SINGLE for k in self._handles[_SINGLE].keys()}  # noqa: SIM118
        self.weight_map = weight_map
        self.fused_experts = any(k.endswith("mlp.experts.gate_up_proj") for k in weight_map)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self.weight_map[name]].get_slice(name).get_shape())

    def get(self, name: str, idx: Index) -> np.ndarray:
        return self._handles[self.weight_map[name]].get_slice(name)[idx]

    def close(self):
        self._handles.clear()


def _unfuse_experts(ckpt: _SafetensorsDir, cfg: Qwen3Config) -> Callable:
    """transformers v5 may write experts fused (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
    [E, H, I]); present them under the per-expert names the map uses."""
    inner = cfg.moe_intermediate_size

    def get(name: str, idx: Index) -> np.ndarray:
        if name in ckpt.weight_map:
            return ckpt.get(name, idx)
        prefix, e, proj, _ = name.rsplit(".", 3)  # "<layer>.mlp.experts", expert, projection, "weight"
        e = int(e)
        if proj == "down_proj":
            return ckpt.get(f"{prefix}.down_proj", (e, *idx))
        rows = range(inner)[idx[0]] if proj == "gate_proj" else range(inner, 2 * inner)[idx[0]]
        return ckpt.get(f"{prefix}.gate_up_proj", (e, slice(rows.start, rows.stop, rows.step), idx[1]))
    return get


def _check_shapes(ckpt: _SafetensorsDir, tmap: dict[tuple, HFTensor], shapes: dict[tuple, tuple]) -> None:
    for path, tensor in tmap.items():
        want = tensor.hf_shape(tuple(shapes[path]))
        for n in tensor.names:
            if n not in ckpt.weight_map:
                if ckpt.fused_experts and tensor.kind == "experts":
                    continue
                raise KeyError(f"Tensor {n!r} is missing from the checkpoint.")
            got = ckpt.shape(n)
            if got != want:
                raise ValueError(f"Tensor {n!r} has shape {got} in the checkpoint, but the config implies {want}.")


def _not_a_checkpoint(path: Path) -> str:
    """Why ``path`` is not an HF-layout checkpoint, with the nearest directory names when it does not exist."""
    if path.exists():
        return (f"{path} holds no config.json: an HF-layout checkpoint directory holds config.json and *.safetensors "
                "(download one with `huggingface-cli download <repo> --local-dir <dir>`, or export a run with "
                "`python -m rollverify_jax.export`).")
    parent = path.parent if path.parent.exists() else None
    siblings = [p.name for p in parent.iterdir() if p.is_dir()] if parent else []
    close = difflib.get_close_matches(path.name, siblings, n=2, cutoff=0.6)
    hint = f" did you mean {' or '.join(str(parent / c) for c in close)}?" if close else ""
    return f"{path} does not exist (an HF-layout checkpoint directory was expected).{hint}"


def read_config(path: str | os.PathLike, dtype: str | None = None, compute_dtype: str | None = None) -> Qwen3Config:
    """The architecture of the HF checkpoint directory ``path`` (its config.json), without its weights."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(_not_a_checkpoint(Path(path)))
    return config_from_hf(json.loads(cfg_file.read_text()), dtype=dtype, compute_dtype=compute_dtype)


def weights_sha256(path: str | os.PathLike) -> str:
    """SHA-256 over a checkpoint directory's ``config.json`` and weight files (each name, then its bytes, in name
    order): the identity of the base an adapter run trains around. Reads every byte once (about 10-40 s for an 8B
    checkpoint on a local disk)."""
    path = Path(path)
    index = path / _INDEX
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [_SINGLE]
    digest = hashlib.sha256()
    for name in ["config.json", *files]:
        if not (path / name).exists():
            raise FileNotFoundError(f"No {name} in {path}; expected an HF-layout checkpoint directory.")
        digest.update(name.encode("utf-8") + b"\0")
        with open(path / name, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def load_pretrained(path: str | os.PathLike, dtype: str | None = None, compute_dtype: str | None = None,
                    mesh: Mesh | None = None, axis_rules: tuple = (),
                    expert_parallel_chunk: int = 4096) -> Qwen3ForCausalLM:
    """Loads an HF Qwen3 / Qwen3-MoE checkpoint directory into a (sharded) NNX model.

    ``dtype``: parameter dtype (default: the checkpoint's); ``compute_dtype`` defaults to ``dtype``.
    With ``mesh``, each parameter lands directly on its logical-axis sharding (``axis_rules``: the
    ``logical_axis_rules`` pairs; empty: the defaults). ``expert_parallel_chunk``: ``Qwen3Config``'s.
    """
    path = Path(path)
    cfg = read_config(path, dtype, compute_dtype).replace(axis_rules=tuple(axis_rules),
                                                          expert_parallel_chunk=expert_parallel_chunk)
    ckpt = _SafetensorsDir(path)
    abstract_model = nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, abs_state = nnx.split(abstract_model)
    flat = dict(nnx.to_flat_state(abs_state))
    tmap = hf_tensor_map(cfg)
    missing = set(flat) - set(tmap)
    if missing:
        raise RuntimeError(f"Internal: no HF mapping for parameters {sorted(missing)}.")
    _check_shapes(ckpt, tmap, {p: v.shape for p, v in flat.items()})
    if mesh is None:
        mesh = mesh_lib.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    specs = dict(nnx.to_flat_state(mesh_lib.param_specs(abs_state, mesh, cfg.rules())))
    target = resolve_dtype(cfg.param_dtype)
    get = _unfuse_experts(ckpt, cfg) if ckpt.fused_experts else ckpt.get
    for p, var in flat.items():
        arr = jax.make_array_from_callback(
            tuple(var.shape), NamedSharding(mesh, specs[p]),
            lambda idx, t=tmap[p], target=target: np.asarray(t.read(get, idx)).astype(target),
        )
        var.set_value(arr) if hasattr(var, "set_value") else setattr(var, "value", arr)
    ckpt.close()
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ----------------------------------------------------------------------------------------------------
# Writing


def _hf_tensors(model: Qwen3ForCausalLM):
    """Yields (HF name, numpy array in HF layout) for every tensor of the model, whole on every process (on
    several processes each tensor is all-gathered: every process must iterate)."""
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for p, tensor in hf_tensor_map(model.cfg).items():
        yield from tensor.write(np.asarray(distributed.fetch(flat[p][...])))


def save_pretrained(model: Qwen3ForCausalLM, path: str | os.PathLike, max_shard_bytes: int = 5 * 2**30) -> None:
    """Writes ``config.json`` and safetensors in HF layout, sharded with an index past ``max_shard_bytes``.

    Each shard is written as soon as it is full, so the host holds at most one shard, not the model. Files go
    to a temporary directory next to ``path`` and are moved in only when all succeeded, so a failure leaves
    nothing half-written. On several processes every process gathers the tensors and process 0 writes.
    """
    if lora.lora_config_of(model) is not None:  # its adapters are not HF tensors: they would be dropped
        raise ValueError("save_pretrained writes a plain model; merge an adapted one first (models.lora.merged_model) "
                         "or write its adapters alone (models.lora.save_peft_adapter).")
    writer = distributed.is_main_process()
    path = Path(path)
    tmp = None
    if writer:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        written: list[tuple[Path, list[str]]] = []  # (file, tensor names), in order
        shard: dict[str, np.ndarray] = {}
        size = total = 0

        def flush():
            if shard:
                written.append((tmp / f"shard-{len(written):05d}.safetensors", list(shard)))
                save_file(shard, str(written[-1][0]), metadata={"format": "pt"})
                shard.clear()

        for name, arr in _hf_tensors(model):  # every process: the gathers are collective
            if not writer:
                continue
            if size and size + arr.nbytes > max_shard_bytes:
                flush()
                size = 0
            shard[name] = arr
            size += arr.nbytes
            total += arr.nbytes
        if writer:
            flush()
            _finish_shards(tmp, written, total)
            (tmp / "config.json").write_text(json.dumps(config_to_hf(model.cfg), indent=2))
            path.mkdir(exist_ok=True)
            for stale in [_SINGLE, _INDEX, *[f.name for f in path.glob("model-*-of-*.safetensors")]]:
                (path / stale).unlink(missing_ok=True)
            for f in tmp.iterdir():
                f.chmod(0o644)
                os.replace(f, path / f.name)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    distributed.barrier("save_pretrained")  # every process returns once the files are in place


def _finish_shards(tmp: Path, written: list[tuple[Path, list[str]]], total: int) -> None:
    """Names the shard files as HF does (one ``model.safetensors``, or ``model-i-of-n`` with an index)."""
    if len(written) == 1:
        os.replace(written[0][0], tmp / _SINGLE)
        return
    n, weight_map = len(written), {}
    for i, (file, names) in enumerate(written):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(file, tmp / fname)
        weight_map.update({k: fname for k in names})
    index = {"metadata": {"total_size": int(total)}, "weight_map": weight_map}
    (tmp / _INDEX).write_text(json.dumps(index, indent=2))


def param_count(model: nnx.Module) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


