"""A trained policy in Hugging Face layout: ``python -m rollverify_jax.export --checkpoint=RUN_OR_STEP --out=DIR``.

``--checkpoint`` is a training workdir (its latest step) or a ``<workdir>/checkpoints/<step>`` directory, resolved
as ``evaluate --checkpoint`` resolves it, and read with the run's ``spec.json`` (``--gin_file``: a spec from gin
instead, for a run from before ``spec.json``). Only the params are read (no optimizer state). ``DIR`` gets safetensors
weights and ``config.json`` (``models.hf.save_pretrained``) and the tokenizer files of the policy the run trained
from, so ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)``
load it, and so do ``evaluate --checkpoint=DIR`` and ``TrainConfig.policy_path``. Everything is written into a
temporary directory next to ``DIR``, flushed to the disk and renamed at the end: a failed export leaves nothing
half-written. ``DIR`` may not be, or hold, the run's workdir, its checkpoints, the policy or tokenizer it reads, or
the working directory (``--overwrite`` would replace them).

A LoRA run (``LoraConfig.rank`` > 0) checkpoints its adapters only: its export reads the base from the run's
policy and writes the merged weights ``W + (alpha / rank) A B``; ``--adapter_only`` writes the adapters alone in
PEFT's format instead (``adapter_config.json``, ``adapter_model.safetensors``: ``peft.PeftModel.from_pretrained(base,
DIR)`` loads them onto the HF base).

The run may live on any ``etils.epath`` filesystem (``--checkpoint=gs://bucket/runs/x`` is read in place); ``DIR``
is local, since the rename at the end needs a filesystem that has one (copy the export to a bucket afterwards).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from etils import epath
from flax import nnx

from rollverify_jax.infra import cli, distributed, storage
from rollverify_jax.models import lora, model_config, save_pretrained
from rollverify_jax.models.hf import config_from_hf
from rollverify_jax.models.qwen3 import Qwen3ForCausalLM
from rollverify_jax.models.tokenizer import TOKENIZER_FILE
from rollverify_jax.run.builder import execution_config, load_policy, resolve_checkpoint, restore_params
from rollverify_jax.run.programs import make_meshes
from rollverify_jax.run.run_dir import run_spec
from rollverify_jax.run.spec import RunSpec, TrainConfig

# What an HF policy directory may hold besides the weights: the tokenizer and its generation defaults.
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


def check_out_dir(out: storage.PathLike, overwrite: bool) -> None:
    """Refuses a non-local directory, a file, or a non-empty directory without ``overwrite``, before any work is
    done."""
    check_out_kind(out)
    check_out_empty(out, overwrite)


def check_out_kind(out: storage.PathLike) -> None:
    """Refuses a non-local ``--out`` or one that is a file."""
    if not storage.is_local(out):
        raise ValueError(f"--out={out} is not a local path: export writes a local directory and renames it at the "
                         "end; copy the result to the bucket afterwards (e.g. gcloud storage cp -r).")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out={out} is a file; pass a directory.")


def check_out_empty(out: storage.PathLike, overwrite: bool) -> None:
    """Refuses a non-empty ``--out`` without ``overwrite``."""
    out = Path(out)
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"--out={out} exists and is not empty; pass --overwrite to replace it, or another --out.")


def abstract_policy(policy_path: str | None, spec: RunSpec) -> Qwen3ForCausalLM:
    """The policy's architecture with shape-only params (``nnx.eval_shape``), adapted when the run trained LoRA
    adapters: the checkpoint's params replace them, so the initial weights are never read."""
    cfg = spec.train
    if policy_path is None:
        model_cfg = model_config(**spec.model)
    else:
        cfg_file = storage.as_path(policy_path) / "config.json"
        if not cfg_file.exists():
            raise FileNotFoundError(f"No config.json in the run's policy directory {policy_path}.")
        model_cfg = config_from_hf(json.loads(cfg_file.read_text()), dtype=cfg.param_dtype,
                                   compute_dtype=cfg.compute_dtype)
    return lora.structure(execution_config(model_cfg, spec), spec.lora)


def tokenizer_dir(policy_path: str | None, cfg: TrainConfig) -> epath.Path:
    """The run's tokenizer directory (``TrainConfig.tokenizer_path``, else the policy's), checked to hold one."""
    path = cfg.tokenizer_path or policy_path
    if path is None:
        raise ValueError("TrainConfig.tokenizer_path is required when the run's policy_path is None.")
    path = storage.as_path(path)
    if not (path / TOKENIZER_FILE).exists():
        raise FileNotFoundError(f"No {TOKENIZER_FILE} in the run's tokenizer directory {path}.")
    return path


def copy_tokenizer(src: epath.Path, dst: Path) -> None:
    """The tokenizer files of ``src`` (any epath filesystem) into the local directory ``dst``."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            (dst / name).write_bytes((src / name).read_bytes())


def check_out_not_in_use(out: Path, in_use: dict[str, storage.PathLike | None],
                         checkpoints: epath.Path) -> None:
    """Refuses an ``--out`` that is, or holds, a directory the export reads or the user works in (``in_use``:
    what -> path), or that lies inside the run's ``checkpoints``: replacing it (``--overwrite``) would delete it,
    and a directory among the checkpoints would be taken for a damaged step."""
    if not storage.is_local(out):
        return  # check_out_dir refuses it
    out = Path(out)
    for what, path in in_use.items():
        if path is None or not storage.is_local(path):
            continue
        if storage.is_within(path, out):
            relation = "is" if Path(path).resolve() == out.resolve() else "holds"
            raise ValueError(f"--out={out} {relation} {what} ({path}): exporting there would replace it; pass "
                             "another --out.")
    if storage.is_local(checkpoints) and storage.is_within(out, checkpoints):
        raise ValueError(f"--out={out} lies inside the run's checkpoints ({checkpoints}); pass another --out.")


def write_atomically(out: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` into a temporary directory next to ``out``, flushed to the disk, then renamed to ``out``
    (replacing what was there); on any failure the temporary directory is removed and ``out`` is untouched."""
    out = Path(os.path.abspath(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the export from other users
        storage.fsync(tmp)
        if out.exists():
            _swap(tmp, out)
        else:
            os.replace(tmp, out)
        storage.fsync_dir(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _swap(new: Path, out: Path) -> None:
    """Replaces the directory ``out`` by ``new``; if the second rename fails, the old ``out`` is put back."""
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    try:
        os.replace(out, old)  # a directory renames over the empty one mkdtemp made
    except BaseException:
        old.rmdir()
        raise
    try:
        os.replace(new, out)
    except BaseException:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def export(spec: RunSpec, checkpoint: storage.PathLike, out: storage.PathLike, overwrite: bool = False,
           adapter_only: bool = False) -> int:
    """Writes the params of ``checkpoint`` (a workdir or a step directory) to ``out`` in HF layout with the
    run's tokenizer (a LoRA run's adapters merged into its base), or with ``adapter_only`` a LoRA run's adapters
    in PEFT's format; returns the step exported. Every input is checked before anything is written."""
    check_out_kind(out)
    if adapter_only and not spec.lora.enabled:
        raise ValueError("--adapter_only exports LoRA adapters, and this run trained every weight (LoraConfig.rank "
                         "= 0): export without --adapter_only.")
    checkpoint, out = storage.as_path(checkpoint), Path(out)
    if (checkpoint / "config.json").exists():
        raise ValueError(f"--checkpoint={checkpoint} is already in Hugging Face layout; export reads a training "
                         "workdir or one of its checkpoints/<step> directories.")
    root, _ = resolve_checkpoint(checkpoint)
    cfg = spec.train
    policy_path = cfg.policy_path
    tok_dir = tokenizer_dir(policy_path, cfg)
    check_out_not_in_use(out, {"the run's workdir": root, "the checkpoint": checkpoint,
                               "the run's checkpoints": root / "checkpoints", "the run's policy": policy_path,
                               "the run's tokenizer": tok_dir, "the working directory": Path.cwd()},
                        root / "checkpoints")
    check_out_empty(out, overwrite)
    model = abstract_policy(policy_path, spec)
    mesh = make_meshes(spec)[0]  # the learner's mesh (async: its own)
    step, params = restore_params(model, mesh, checkpoint, spec)
    graphdef, _, frozen = lora.split_trainable(model)
    if spec.lora.enabled and not adapter_only:  # the base the adapters were trained on (its hash was checked)
        frozen = nnx.state(load_policy(spec, spec.train, mesh), nnx.Param)
    trained = nnx.merge(graphdef, params, frozen)

    def save(path: Path) -> None:
        if adapter_only:
            lora.save_peft_adapter(trained, path, base_model=policy_path)
        else:
            save_pretrained(lora.merged_model(trained) if spec.lora.enabled else trained, path)

    def write(tmp: Path) -> None:
        save(tmp)
        if not adapter_only:
            copy_tokenizer(tok_dir, tmp)

    if distributed.is_main_process():
        write_atomically(out, write)
    else:  # several processes: this one joins the gathers of each tensor; process 0 writes
        save(out)
    distributed.barrier("export")
    return step


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="a training workdir (latest step) or checkpoints/<step>")
    ap.add_argument("--out", required=True, help="the HF-layout directory to write")
    ap.add_argument("--overwrite", action="store_true", help="replace --out when it exists and is not empty")
    ap.add_argument("--adapter_only", action="store_true",
                    help="a LoRA run: write its adapters alone in PEFT's format (adapter_config.json, "
                         "adapter_model.safetensors) instead of the merged weights")
    ap.add_argument("--gin_file", action="append", default=[],
                    help="read the run's spec from gin (repeatable; default: the workdir's spec.json)")
    ap.add_argument("--gin_param", action="append", default=[],
                    help="gin binding on top of the spec, e.g. TrainConfig.param_dtype=...")
    ap.add_argument("--traceback", action="store_true", help="show the full stack of an input error")
    cli.add_process_flags(ap)
    args = ap.parse_args(argv)
    cli.run_cli(lambda: _main(args), args.traceback)


def _main(args: argparse.Namespace) -> None:
    check_out_kind(args.out)  # the cheapest check first, as export() makes it
    spec = run_spec(args.checkpoint, args.gin_file, args.gin_param)
    cli.start_process(spec, args)
    step = export(spec, args.checkpoint, args.out, args.overwrite, args.adapter_only)
    print(f"exported step {step} of {args.checkpoint} to {args.out}")


if __name__ == "__main__":
    main()
