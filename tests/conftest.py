"""Test setup: 8 fake CPU devices so sharding is tested on CPU. Must run before JAX is imported."""

import collections
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ROLLVERIFY_COMPILATION_CACHE", "0")  # no persistent cache unless a test asks for one
# Runs compile each program at first use (a test's run uses a few of its plan's) unless a test asks for the warmup.
os.environ.setdefault("ROLLVERIFY_WARMUP", "0")
# XLA's CPU backend without LLVM's optimizations (JAX's switch: xla_backend_optimization_level=0, no expensive
# LLVM passes; XLA's HLO passes run as before, so every program is the same computation): the suite's tiny
# programs cost more to optimize than to run, and a unit module's CPU time drops by about a third. Results can
# differ from an optimized build's in the last bits (LLVM fuses multiply-adds); the tests' exact comparisons are
# between runs of this same build. Inherited by the subprocesses tests launch (the CLIs, the multi-process
# runs); test_aot.py turns it off for its TPU compiles; JAX_DISABLE_MOST_OPTIMIZATIONS=0 keeps every optimization.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import gin  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402  (after the environment above, which must precede JAX's import)

from rollverify_jax.models import init_model, model_config  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "end_to_end: a whole run or script (tens of seconds to minutes of compiling "
                            "and training); its module starts first (pytest_collection_modifyitems)")
    if getattr(config.option, "dist", "no") == "loadfile":
        config.option.loadscopereorder = False  # the order below replaces xdist's (by tests per module)


def pytest_collection_modifyitems(config, items):
    """Modules marked ``end_to_end`` first, then the others by their number of tests (most first, as xdist orders
    them), each module's tests together and in their order. ``make test`` runs ``--dist loadfile`` on 2 workers,
    which take whole modules in this order: the longest start first and the short ones fill in, so the workers
    end together (xdist's own order put these few-test, several-minute modules last, where one worker ran them
    while the other sat idle; a worker also takes its next module while two of its tests are left, so a slow
    module with few tests at the end of the order still keeps one worker busy alone: mark its slow test)."""
    counts = collections.Counter(item.path for item in items)
    heavy = {item.path for item in items if item.get_closest_marker("end_to_end")}
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.path, i)
    items.sort(key=lambda item: (item.path not in heavy, -counts[item.path], first[item.path]))


@pytest.fixture(autouse=True)
def clean_gin():
    """Every test starts and ends with no gin bindings, so one test's configuration never reaches another."""
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture
def spec_of():
    """``spec_of(*bindings)``: the ``RunSpec`` those gin bindings (lines of gin) give, the bindings cleared after."""
    from rollverify_jax.run.spec import RunSpec

    def build(*bindings: str) -> RunSpec:
        gin.clear_config()
        try:
            gin.parse_config(list(bindings))
            return RunSpec.from_gin()
        finally:
            gin.clear_config()
    return build


_CACHE_SETTINGS = {"jax_compilation_cache_dir": None, "jax_persistent_cache_min_compile_time_secs": 0.0,
                   "jax_persistent_cache_min_entry_size_bytes": 0,
                   # A size bound turns on JAX's file lock around each read and write of the directory, which the
                   # xdist workers share (without it, one could read an entry another is still writing).
                   "jax_compilation_cache_max_size": 4 * 2**30}


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory):
    """JAX's persistent compilation cache, on for one module (``pytestmark = pytest.mark.usefixtures(...)``) and
    restored after it. The end-to-end modules build a trainer per test, and each build jits its train step and
    log-prob function anew (the in-memory cache is keyed by the function), so every run compiled the same
    programs again; from this directory, shared by the session's xdist workers, each is compiled once. A loaded
    executable computes what a fresh compile does, so exact comparisons (resume equality) are unaffected. After
    the module JAX's in-memory caches are cleared too, so no executable loaded from the directory outlives it: the
    modules after it compile as they would without it."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    root = tmp_path_factory.getbasetemp()
    path = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "xla_cache"
    path.mkdir(exist_ok=True)
    saved = {name: getattr(jax.config, name) for name in _CACHE_SETTINGS}
    for name, value in {**_CACHE_SETTINGS, "jax_compilation_cache_dir": str(path)}.items():
        jax.config.update(name, value)
    cc.reset_cache()
    yield path
    jax.clear_caches()
    for name, value in saved.items():
        jax.config.update(name, value)
    cc.reset_cache()


@pytest.fixture(scope="session")
def model():
    """The random tiny Qwen3 (seed 0) shared by the rollout tests. Treat it as read-only: a test that needs other
    weights builds them (``nnx.split`` + new state), it never updates this module in place."""
    return init_model(model_config("tiny"), seed=0)


@pytest.fixture(scope="session")
def policy(tmp_path_factory):
    """A random 2-layer tiny Qwen3 with the synthetic task's character tokenizer, on disk in HF layout: the policy
    of the tiny training runs (``shared.run_params``)."""
    from rollverify_jax.data.synthetic import char_vocabulary
    from rollverify_jax.models import build_char_tokenizer, save_pretrained

    path = tmp_path_factory.mktemp("policy")
    tok = build_char_tokenizer(char_vocabulary(), ["<|endoftext|>", "<pad>"], path, eos_tokens=["<|endoftext|>"],
                               pad_token="<pad>")
    vocab = -(-tok.vocab_size // 8) * 8
    save_pretrained(init_model(model_config("tiny", vocab_size=vocab, num_hidden_layers=2), seed=3), path)
    return path


@pytest.fixture(scope="session")
def sandbox_available():
    """Tests of the python tool's real sandbox skip, saying why, on a machine that cannot run it (e.g. no user
    namespaces and no fallback allowed); ``test_tools.py`` covers the refusal itself."""
    from rollverify_jax.tools import SandboxConfig, check_sandbox

    try:
        check_sandbox(SandboxConfig(timeout_s=5.0, memory_mb=256))
    except RuntimeError as e:
        pytest.skip(f"no sandbox on this machine: {str(e)[:80]}")
