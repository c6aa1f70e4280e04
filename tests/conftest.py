"""Test setup: 8 fake CPU devices so sharding is tested on CPU. Must run before JAX is imported."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ROLLVERIFY_COMPILATION_CACHE", "0")  # no persistent cache unless a test asks for one

import gin  # noqa: E402
import pytest  # noqa: E402  (after the environment above, which must precede JAX's import)

from rollverify_jax.models import init_model, model_config  # noqa: E402


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
