"""Run storage through etils.epath (local paths and gs:// served by a fake bucket) and the persistent compilation
cache setting."""

import contextlib
import json
import os
from pathlib import Path

import gin
import jax
import jax.numpy as jnp
import pytest
from etils import epath
from etils.epath import testing as epath_testing

from rollverify_jax.infra import compile_cache, storage
from rollverify_jax.run import checkpoint as checkpoint_lib
from rollverify_jax.run.checkpoint import COMMIT_FILE, CheckpointConfig, Checkpointer
from rollverify_jax.run.evaluation import write_samples
from rollverify_jax.run.metrics import MetricsWriter, read_metrics, save_operative_config
from rollverify_jax.run.spec import RunSpec

TINY_GIN = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_rollverify.gin")


def test_local_paths_behave_like_pathlib(tmp_path):
    p = storage.as_path(tmp_path / "run")
    assert p == tmp_path / "run" and str(p) == str(tmp_path / "run")
    assert storage.is_local(p) and storage.is_local("runs/x") and not storage.is_local("gs://b/runs/x")
    assert storage.absolute("runs/x") == Path.cwd() / "runs" / "x"
    assert str(storage.absolute("gs://b/runs/x")) == "gs://b/runs/x"  # never prefixed with the working directory
    p.mkdir()
    storage.write_text_atomically(p / "a.txt", "x")
    storage.write_text_atomically(p / "a.txt", "y")
    assert (tmp_path / "run" / "a.txt").read_text() == "y" and os.listdir(tmp_path / "run") == ["a.txt"]
    storage.remove_tree(p)
    storage.remove_tree(p)  # already gone: no error
    assert not (tmp_path / "run").exists()


def _recording_fsync(monkeypatch) -> tuple[list[str], list[int]]:
    """(paths fsynced, how many fsyncs had happened at each os.replace) while the test runs."""
    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda s, d: (renamed.append(len(synced)), real_replace(s, d)))
    return synced, renamed


def test_an_atomic_write_is_on_the_disk_before_its_rename(tmp_path, monkeypatch):
    """Metrics rewrites and sample logs go through write_text_atomically: the temporary file is fsynced before
    the rename publishes it (a crash after the rename must not leave the name on empty contents)."""
    synced, renamed = _recording_fsync(monkeypatch)
    storage.write_text_atomically(tmp_path / "metrics.jsonl", "{}\n")
    assert renamed == [1] and synced[0].startswith(str(tmp_path / ".metrics.jsonl.")), (synced, renamed)
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]
    synced.clear()
    storage.fsync(tmp_path)  # a tree: each file and directory
    assert str(tmp_path / "metrics.jsonl") in synced and str(tmp_path) in synced


def test_the_metrics_rewrite_and_the_sample_log_are_on_the_disk_before_their_rename(tmp_path, monkeypatch):
    with MetricsWriter(tmp_path, use_tensorboard=False, active=True) as writer:
        for step in range(3):
            writer.write(step, {"x": 1.0})
    synced, renamed = _recording_fsync(monkeypatch)
    MetricsWriter(tmp_path, use_tensorboard=False, resume_step=2, active=True).close()  # drops step 2's row
    write_samples(tmp_path / "samples" / "step_2.jsonl", [{"response": "r"}], step=2)
    assert len(renamed) == 2 and all(n > 0 for n in renamed), (synced, renamed)
    assert synced[0].startswith(str(tmp_path / ".metrics.jsonl."))
    assert any(p.startswith(str(tmp_path / "samples" / ".step_2.jsonl.")) for p in synced[renamed[0]:renamed[1]])
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("old")
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError, match="No space"):
        storage.write_text_atomically(tmp_path / "a.txt", "new")
    assert os.listdir(tmp_path) == ["a.txt"] and (tmp_path / "a.txt").read_text() == "old"


def test_check_writable_refuses_before_the_work(tmp_path):
    (tmp_path / "file.txt").write_text("")
    (tmp_path / "dir").mkdir()
    storage.check_writable(tmp_path / "new" / "deeper" / "out.jsonl", "--out")  # parents are made at write time
    assert sorted(os.listdir(tmp_path)) == ["dir", "file.txt"]  # the probe is removed, nothing created
    with pytest.raises(ValueError, match="is a directory"):
        storage.check_writable(tmp_path / "dir", "--out")
    with pytest.raises(ValueError, match="file.txt is a file, not a directory"):
        storage.check_writable(tmp_path / "file.txt" / "out.jsonl", "--out")
    with pytest.raises(ValueError, match="cannot be written"):
        storage.check_writable("/proc/out.jsonl", "--out")
    storage.check_writable("gs://bucket/out.jsonl", "--out")  # not probed


def test_is_within(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "run")
    assert storage.is_within(tmp_path / "run" / "x", tmp_path) and storage.is_within(tmp_path, tmp_path)
    assert storage.is_within(tmp_path / "link", tmp_path / "run") and not storage.is_within(tmp_path, tmp_path / "run")
    assert not storage.is_within(tmp_path / "runs", tmp_path / "run")
    assert storage.is_within("gs://b/runs/x", "gs://b/runs") and not storage.is_within("gs://b/runsx", "gs://b/runs")
    assert not storage.is_within("gs://b/runs", tmp_path)


def test_etils_offers_no_memory_scheme():
    """Why the non-local tests below fake a gs:// bucket instead of using an in-memory filesystem."""
    with pytest.raises(KeyError):
        epath.Path("memory://bucket/x")


@contextlib.contextmanager
def fake_bucket(root: Path, calls: list):
    """``gs://`` paths served from ``root`` through epath's own backend hooks, with an object store's limits: no
    append mode. Any code that bypasses epath (``open``, ``os.replace`` on the string) cannot reach these files."""
    def local(path):
        path = os.fspath(path)
        return str(root / path.removeprefix("gs://")) if path.startswith("gs://") else path

    def mapped(name):
        def fn(original, path, *args, **kwargs):
            calls.append((name, os.fspath(path)))
            return original(local(path), *args, **kwargs)
        return fn

    def open_(original, path, mode):
        if os.fspath(path).startswith("gs://") and "a" in mode:
            raise NotImplementedError(f"an object store cannot append ({path})")
        calls.append(("open", os.fspath(path)))
        return original(local(path), mode)

    def two(name):
        def fn(original, path, dst, **kwargs):
            calls.append((name, os.fspath(path)))
            return original(local(path), local(dst), **kwargs)
        return fn

    hooks = {name: mapped(name) for name in ("exists", "isdir", "listdir", "makedirs", "mkdir", "remove", "rmtree",
                                             "stat")}
    with epath_testing.mock_epath(open=open_, rename=two("rename"), replace=two("replace"), copy=two("copy"),
                                  **hooks):
        yield


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    """(local mirror of gs://bucket, calls through epath); the working directory is checked to stay empty (a
    path string used outside epath would create ./gs:/bucket/...)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    calls = []
    with fake_bucket(tmp_path / "gcs", calls):
        yield tmp_path / "gcs" / "bucket", calls
    assert os.listdir(cwd) == []


def test_metrics_config_and_samples_are_written_to_a_bucket(bucket):
    mirror, calls = bucket
    workdir = "gs://bucket/runs/x"
    with MetricsWriter(workdir, use_tensorboard=False, active=True) as writer:
        for step in range(3):
            writer.write(step, {"reward/mean": step / 4})
        assert len(read_metrics(workdir)) == 3  # every record is in the object as soon as it is written
    lines = (mirror / "runs/x/metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]
    with MetricsWriter(workdir, use_tensorboard=False, resume_step=2, active=True) as writer:  # a resume at step 2
        writer.write(2, {"reward/mean": 0.9})
    assert [(r["step"], r["reward/mean"]) for r in read_metrics(f"{workdir}/metrics.jsonl")] == \
        [(0, 0.0), (1, 0.25), (2, 0.9)]

    gin.parse_config("compilation_cache.dir = None")
    try:
        spec = RunSpec.from_gin()
    finally:
        gin.clear_config()
    save_operative_config(workdir, spec.operative_text(), spec.gin_text)
    assert "compilation_cache.dir = None" in (mirror / "runs/x/config.gin").read_text()
    assert "compilation_cache.dir = None" in (mirror / "runs/x/operative_config.gin").read_text()

    write_samples(f"{workdir}/samples/step_3.jsonl", [{"problem": 0, "response": "4"}], step=3)
    assert json.loads((mirror / "runs/x/samples/step_3.jsonl").read_text()) == {"step": 3, "problem": 0,
                                                                                "response": "4"}
    assert any(path.startswith("gs://bucket/runs/x/") for _, path in calls)  # the writes went through epath


def test_a_local_metrics_file_is_still_appended_to(tmp_path, monkeypatch):
    """On a local disk the writer keeps one open handle (it does not rewrite the file per record)."""
    opened = []
    cls = type(storage.as_path(tmp_path))
    real_open = cls.open
    monkeypatch.setattr(cls, "open", lambda self, mode="r", **kw: (opened.append(mode), real_open(self, mode, **kw))[1])
    with MetricsWriter(tmp_path, use_tensorboard=False, active=True) as writer:
        for step in range(3):
            writer.write(step, {"x": 1.0})
    assert opened == ["a"] and len(read_metrics(tmp_path)) == 3


def test_workdir_of_a_config_can_be_a_bucket():
    from rollverify_jax.export import check_out_dir
    gin.parse_config("TrainConfig.runs_root = 'gs://bucket/runs'")
    workdir = RunSpec.from_gin().workdir([TINY_GIN])
    assert str(workdir) == "gs://bucket/runs/tiny_rollverify"
    with pytest.raises(ValueError, match="not a local path"):
        check_out_dir("gs://bucket/exports/x", overwrite=False)


# -- checkpoints on a filesystem every host shares ---------------------------------------------------------------


def _bare_step(tmp_path, step: int) -> Path:
    root = tmp_path / "checkpoints" / str(step)
    root.mkdir(parents=True)
    return root


@pytest.mark.parametrize("primary", [True, False])
def test_only_process_0_sets_an_uncommitted_step_aside(tmp_path, monkeypatch, primary):
    """On several hosts every process opens the same directory: one moves things, the others wait for it."""
    synced = []
    monkeypatch.setattr(checkpoint_lib, "_is_primary", lambda: primary)
    monkeypatch.setattr(checkpoint_lib, "_sync", synced.append)
    _bare_step(tmp_path, 5)
    with Checkpointer(tmp_path, CheckpointConfig(async_save=False)) as ckpt:
        assert ckpt.latest_step() is None
    assert (tmp_path / "checkpoints" / "5").is_dir() != primary
    assert (tmp_path / "checkpoints" / "5.uncommitted").is_dir() == primary
    assert synced == ["rollverify_checkpoint_scanned"]  # every process, after process 0 is done


def test_only_process_0_sets_an_unreadable_step_aside(tmp_path, monkeypatch, capsys):
    with Checkpointer(tmp_path, CheckpointConfig(async_save=False)) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"x": jnp.full(4, float(step))}, {"step": step}, force=True)
    (tmp_path / "checkpoints" / "2" / "extra" / "metadata").unlink()
    synced = []
    monkeypatch.setattr(checkpoint_lib, "_is_primary", lambda: False)
    monkeypatch.setattr(checkpoint_lib, "_sync", synced.append)
    with Checkpointer(tmp_path, CheckpointConfig(async_save=False)) as ckpt:
        step, _, extra = ckpt.restore()
    assert step == 1 and extra == {"step": 1}
    assert (tmp_path / "checkpoints" / "2" / COMMIT_FILE).exists()  # left for process 0 to move
    assert synced == ["rollverify_checkpoint_scanned", "rollverify_checkpoint_2_set_aside"]
    assert "cannot be read" not in capsys.readouterr().err  # process 0 says it, once


# -- the persistent compilation cache ----------------------------------------------------------------------------


@pytest.fixture
def jax_cache_config(monkeypatch):
    """Restores JAX's cache settings (process-wide) after the test; the environment variable starts unset."""
    monkeypatch.delenv(compile_cache.ENV_VAR, raising=False)
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    saved = {name: getattr(jax.config, name) for name in names}
    yield
    from jax.experimental.compilation_cache import compilation_cache as cc

    for name, value in saved.items():
        jax.config.update(name, value)
    cc.reset_cache()


def test_the_cache_setting_applies_jax_config(tmp_path, jax_cache_config):
    assert compile_cache.compilation_cache(dir=str(tmp_path / "xla"), min_compile_time_s=0.0,
                                           min_entry_size_bytes=-1) == str(tmp_path / "xla")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == -1
    jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.arange(7.0)).block_until_ready()  # a program no other test compiles
    assert any((tmp_path / "xla").iterdir())  # JAX wrote it to the cache


def test_none_leaves_the_cache_off(jax_cache_config):
    gin.parse_config("compilation_cache.dir = None")
    try:
        assert compile_cache.compilation_cache(**RunSpec.from_gin().compile_cache) is None
    finally:
        gin.clear_config()
    assert jax.config.jax_compilation_cache_dir is None


def test_the_environment_variable_overrides_the_setting(tmp_path, monkeypatch, jax_cache_config):
    monkeypatch.setenv(compile_cache.ENV_VAR, "0")
    assert compile_cache.compilation_cache(dir=str(tmp_path)) is None
    assert jax.config.jax_compilation_cache_dir is None
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "env"))
    assert compile_cache.compilation_cache(dir=None) == str(tmp_path / "env")
    monkeypatch.delenv(compile_cache.ENV_VAR)
    assert compile_cache.cache_dir("~/x") == str(Path.home() / "x") and compile_cache.cache_dir("gs://b/x") == "gs://b/x"


def test_jax_own_environment_variables_win(tmp_path, monkeypatch, jax_cache_config):
    """JAX_* variables are read by JAX at import; an explicit one is the user's choice, left as JAX set it."""
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "theirs"))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    assert compile_cache.compilation_cache(dir=str(tmp_path / "ours"), min_compile_time_s=2.0,
                                           min_entry_size_bytes=7) == str(tmp_path / "theirs")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == 7  # not set by the environment


class _Stop(Exception):
    pass


@pytest.mark.parametrize("cli", ["train", "evaluate", "aot"])
def test_every_cli_turns_the_cache_on_before_it_compiles(cli, tmp_path, monkeypatch, jax_cache_config):
    """Each entry point applies the setting right after parsing gin (stopped at its next call here)."""
    import importlib

    module = importlib.import_module(f"rollverify_jax.{cli}")
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "xla"))
    nxt = {"train": "train", "evaluate": "resolve_checkpoint", "aot": "compile_run"}[cli]
    monkeypatch.setattr(module, nxt, lambda *a, **k: (_ for _ in ()).throw(_Stop()))
    args = {"evaluate": ["--checkpoint", str(tmp_path / "run")]}.get(cli, [])
    try:
        with pytest.raises(_Stop):
            module.main([f"--gin_file={TINY_GIN}", *args])
    finally:
        gin.clear_config()
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
