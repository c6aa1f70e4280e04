"""rollverify_jax: GRPO with partial rollout and RollVerify verification, in JAX."""

import glob as _glob
import importlib.util as _importlib_util
import os as _os


def _skip_absent_tpu() -> None:
    """libtpu (installed for the deviceless TPU compile, ``rollverify_jax.aot``) makes JAX probe for TPU chips
    at start-up, which prints errors on a machine without one. Where no TPU device file exists, JAX is told
    which platforms to use instead (an explicit JAX_PLATFORMS always wins)."""
    if "JAX_PLATFORMS" in _os.environ or _importlib_util.find_spec("libtpu") is None:
        return
    if _glob.glob("/dev/accel*") or _glob.glob("/dev/vfio/[0-9]*"):
        return  # a TPU VM
    _os.environ["JAX_PLATFORMS"] = "cuda,cpu" if _glob.glob("/dev/nvidia[0-9]*") else "cpu"


_skip_absent_tpu()
