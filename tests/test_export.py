"""Export of a run's checkpoint to Hugging Face layout: transformers loads the trained params and the tokenizer."""

import dataclasses
import functools
import os
import re
import shutil
from pathlib import Path

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from shared import POLICY, make_checkpoint

from rollverify_jax import export
from rollverify_jax.models import Tokenizer, load_pretrained
from rollverify_jax.run import run_dir as run_dir_lib

TEXT = "Start 64. -9 -6. Compute. 64-9=55."


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run with checkpoints at steps 1 and 2 (different params); returns (workdir, {step: params})."""
    workdir = tmp_path_factory.mktemp("run")
    return workdir, {step: make_checkpoint(workdir, step) for step in (1, 2)}


def _export(*args):
    export.main([str(a) for a in args])


@functools.cache
def _graphdef():
    return nnx.split(load_pretrained(POLICY))[0]


@jax.jit
def _forward(params, tokens):
    return nnx.merge(_graphdef(), params)(tokens)


def _logits(params, tokens):
    """The project's model with ``params`` (jitted: eager dispatch of a first call costs seconds)."""
    return np.asarray(_forward(params, jnp.asarray(tokens, jnp.int32)))


def _hf_logits(path, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("which, step", [("run", 2), ("checkpoints/1", 1)])
def test_export_loads_in_transformers_with_the_checkpoint_params(run_dir, tmp_path, capsys, which, step):
    workdir, params = run_dir
    checkpoint = workdir if which == "run" else workdir / which
    _export(f"--checkpoint={checkpoint}", f"--out={tmp_path / 'hf'}")
    assert f"exported step {step} of" in capsys.readouterr().out
    tokens = np.asarray([Tokenizer.from_dir(POLICY).encode(TEXT)])
    got = _hf_logits(tmp_path / "hf", tokens)
    np.testing.assert_allclose(got, _logits(params[step], tokens), atol=1e-4, rtol=0)
    initial = _logits(nnx.state(load_pretrained(POLICY), nnx.Param), tokens)
    assert np.abs(got - initial).max() > 1e-2  # the params are the checkpoint's, not the initial policy's
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok(TEXT, add_special_tokens=False).input_ids == tokens[0].tolist()
    assert hf_tok.eos_token == "<|endoftext|>"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary directory left behind


def test_existing_output_needs_overwrite(run_dir, tmp_path, capsys):
    workdir, params = run_dir
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        _export(f"--checkpoint={workdir}", f"--out={out}")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and "--overwrite" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    _export(f"--checkpoint={workdir / 'checkpoints' / '1'}", f"--out={out}", "--overwrite")
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    tokens = np.asarray([Tokenizer.from_dir(POLICY).encode(TEXT)])
    np.testing.assert_allclose(_hf_logits(out, tokens), _logits(params[1], tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("checkpoint, out, message", [
    ("missing", "hf", "No checkpoint under"),
    ("run/checkpoints/7", "hf", r"No committed checkpoint for step 7 .*available steps: \[1, 2\]"),
    ("run", "file.txt", "is a file"),
    ("hf_policy", "hf", "already in Hugging Face layout"),
])
def test_bad_input_is_one_error_and_writes_nothing(run_dir, tmp_path, capsys, checkpoint, out, message):
    workdir, _ = run_dir
    (tmp_path / "file.txt").write_text("")
    (tmp_path / "hf_policy").mkdir()
    (tmp_path / "hf_policy" / "config.json").write_text("{}")
    before = sorted(p.name for p in tmp_path.iterdir())
    path = workdir / checkpoint.removeprefix("run/") if checkpoint.startswith("run") else tmp_path / checkpoint
    with pytest.raises(SystemExit) as exit_info:
        _export(f"--checkpoint={path}", f"--out={tmp_path / out}")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("error: ") == 1 and "Traceback" not in err, err
    assert re.search(message, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_run_without_spec_json_is_one_error_and_its_gin_config_still_exports(run_dir, tmp_path, capsys):
    workdir, params = run_dir
    shutil.copytree(workdir, tmp_path / "old")
    (tmp_path / "old" / "spec.json").unlink()  # a run from before spec.json
    with pytest.raises(SystemExit) as exit_info:
        _export(f"--checkpoint={tmp_path / 'old'}", f"--out={tmp_path / 'hf'}")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "spec.json does not exist" in err and "--gin_file" in err, err
    assert not (tmp_path / "hf").exists()
    (tmp_path / "config.gin").write_text(f"TrainConfig.policy_path = '{POLICY}'\n")
    _export(f"--checkpoint={tmp_path / 'old'}", f"--out={tmp_path / 'hf'}", f"--gin_file={tmp_path / 'config.gin'}")
    tokens = np.asarray([Tokenizer.from_dir(POLICY).encode(TEXT)])
    np.testing.assert_allclose(_hf_logits(tmp_path / "hf", tokens), _logits(params[2], tokens), atol=1e-4, rtol=0)


def test_a_failure_while_writing_leaves_nothing(run_dir, tmp_path, monkeypatch):
    workdir, _ = run_dir
    spec = run_dir_lib.read_spec(workdir)

    def broken(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(export, "copy_tokenizer", broken)
    gin.clear_config()
    with pytest.raises(OSError, match="disk full"):
        export.export(spec, workdir, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "keep.txt").write_text("mine")
    with pytest.raises(OSError, match="disk full"):  # an export that would replace a directory keeps it
        export.export(spec, workdir, tmp_path / "old", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["old"] and (tmp_path / "old" / "keep.txt").read_text() == "mine"


@pytest.fixture
def own_run(run_dir, tmp_path):
    """A copy of the run whose policy and tokenizer are copies too (its spec.json's TrainConfig.policy_path and
    TrainConfig.tokenizer_path point at them), under tmp_path/work: a test that exports over them can only
    damage its own files."""
    workdir, _ = run_dir
    work = tmp_path / "work"
    shutil.copytree(workdir, work / "run")
    shutil.copytree(POLICY, work / "policy")
    shutil.copytree(POLICY, work / "tokenizer")
    spec = run_dir_lib.read_spec(work / "run")
    run_dir_lib.write_spec(work / "run", dataclasses.replace(spec, train=dataclasses.replace(
        spec.train, policy_path=str(work / "policy"))))
    return work


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("out, cwd, message", [
    ("run", None, r"is the run's workdir"),
    (".", None, r"holds the run's workdir"),  # a parent of the workdir
    ("run/checkpoints", None, r"is the run's checkpoints"),
    ("run/checkpoints/2", None, r"lies inside the run's checkpoints"),
    ("policy", None, r"is the run's policy"),
    ("tokenizer", None, r"is the run's tokenizer"),
    (".", "elsewhere", r"is the working directory"),
    ("..", "elsewhere/inner", r"holds the working directory"),
])
def test_overwrite_never_replaces_the_run_its_inputs_or_the_working_directory(own_run, monkeypatch, capsys, out,
                                                                           cwd, message):
    """Each of these --out --overwrite used to rename the directory aside and delete it (``--out=.`` raised a
    traceback and left an empty ``..old-*``): now one line, exit 2, nothing touched."""
    if cwd is not None:
        (own_run / cwd).mkdir(parents=True)
        monkeypatch.chdir(own_run / cwd)
        out_path = out
    else:
        out_path = own_run / out
    before = _tree(own_run)
    with pytest.raises(SystemExit) as exit_info:
        _export(f"--checkpoint={own_run / 'run'}", f"--out={out_path}", "--overwrite",
                f"--gin_param=TrainConfig.tokenizer_path = '{own_run / 'tokenizer'}'")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("error: ") == 1 and "Traceback" not in err, err
    assert re.search(message, err), err
    assert _tree(own_run) == before


def test_a_failed_swap_puts_the_old_export_back(tmp_path, monkeypatch):
    """The second rename of a replacement fails: the previous export is back under its name, nothing else
    is left."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    real = os.replace

    def replace(src, dst):
        if Path(src).name.startswith(".hf.export-"):
            raise OSError(28, "No space left on device")
        return real(src, dst)
    monkeypatch.setattr(export.os, "replace", replace)
    with pytest.raises(OSError, match="No space"):
        export.write_atomically(out, lambda tmp: (tmp / "model.safetensors").write_text("new"))
    assert [p.name for p in tmp_path.iterdir()] == ["hf"] and (out / "keep.txt").read_text() == "mine"


def test_the_export_is_flushed_to_the_disk_before_it_is_renamed(tmp_path, monkeypatch):
    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    monkeypatch.setattr(export.os, "replace", lambda s, d: (renamed.append(len(synced)), real_replace(s, d)))
    export.write_atomically(tmp_path / "hf", lambda tmp: (tmp / "model.safetensors").write_text("w"))
    assert renamed and any(p.endswith("model.safetensors") for p in synced[:renamed[0]]), (synced, renamed)
