"""docs/config_reference.md is what rollverify_jax.studies.config_reference writes from the registered
configurables (CI runs this, so a field added without regenerating the reference fails CI), and it lists every
setting of every part."""

import dataclasses
from pathlib import Path

import pytest

from rollverify_jax.run.spec import PARTS
from rollverify_jax.studies import config_reference

ROOT = Path(__file__).resolve().parents[1]


def test_the_checked_in_reference_is_current():
    reference = config_reference
    if (ROOT / "docs" / "config_reference.md").read_text() != reference.render():
        pytest.fail("docs/config_reference.md is out of date (a configurable's fields, defaults or their docs "
                    f"changed): run `{reference.COMMAND}` and commit the file.")


def test_every_setting_has_a_row_with_its_documentation():
    text = config_reference.render()
    for gin_name, target in PARTS.values():
        assert f"## {gin_name}\n" in text
        if dataclasses.is_dataclass(target):
            for f in dataclasses.fields(target):
                if f.init:
                    assert f"| `{gin_name}.{f.name}` |" in text, f"{gin_name}.{f.name}"
    # A trailing comment, a docstring entry naming two fields, a function's docstring entry, a per-call argument
    # left out, and what a resume does with a changed value: refuses it (run-defining), follows it with a warning
    # (execution), or does not compare it (bookkeeping).
    assert "| `RolloutConfig.batch_groups` | `int` | `8` | refuses | B: complete groups per training batch |" in text
    assert "| `LossConfig.eps_high` | `float` | `0.28` | refuses | PPO clip range" in text
    assert "| `initialize.heartbeat_timeout_s` | `int` | `60` | warns | a process that died or hangs" in text
    assert "| `EngineConfig.live_slots` | `bool` | `True` | warns | decode runs over the slots" in text
    assert "`make_mesh.devices`" not in text and "| `TrainConfig.num_steps` | `int` | `40` | no |" in text
