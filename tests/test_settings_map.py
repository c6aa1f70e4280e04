"""docs/settings_map.md names only real settings: every gin binding in its last column is a field of a registered
configurable, and a binding to a registered choice (loss, aggregation, advantage, dataset, schedule, rollout mode)
names one that exists. A renamed setting or choice fails here, not in a user's first run."""

import dataclasses
import inspect
import re
from pathlib import Path

from rollverify_jax.data.datasets import DATASETS
from rollverify_jax.rl.advantages import ADVANTAGES
from rollverify_jax.rl.learner import SCHEDULES
from rollverify_jax.rl.losses import AGGREGATIONS, LOSSES
from rollverify_jax.rl.partial_rollout import MODES
from rollverify_jax.run.spec import PARTS

MAP = Path(__file__).resolve().parents[1] / "docs" / "settings_map.md"
BINDING = re.compile(r"`([A-Za-z_]+)\.([a-z_]+)(?: = ([^`]+))?`")
CHOICES = {("LearnerConfig", "loss_name"): LOSSES, ("LossConfig", "aggregation"): AGGREGATIONS,
           ("TrainConfig", "advantage"): ADVANTAGES, ("TrainConfig", "train_dataset"): DATASETS,
           ("TrainConfig", "eval_dataset"): DATASETS, ("OptimizerConfig", "schedule"): SCHEDULES,
           ("RolloutConfig", "mode"): MODES}


def _settings() -> dict[str, set[str]]:
    out = {}
    for gin_name, target in PARTS.values():
        if dataclasses.is_dataclass(target):
            out[gin_name] = {f.name for f in dataclasses.fields(target) if f.init}
        else:
            out[gin_name] = set(inspect.signature(target).parameters)
    return out


def _our_column() -> list[str]:
    cells = []
    for line in MAP.read_text().splitlines():
        if line.startswith("| ") and not line.startswith("| what") and not line.startswith("| ---"):
            cells.append(line.rstrip(" |").rsplit(" | ", 1)[-1])
    return cells


def test_every_binding_in_the_map_is_a_real_setting_and_choice():
    settings, cells = _settings(), _our_column()
    assert len(cells) >= 40, "the map's tables were not found"
    bound = 0
    for cell in cells:
        for part, field, value in BINDING.findall(cell):
            if part not in settings:
                continue  # a dotted name that is not a binding here (e.g. a file name)
            bound += 1
            assert field in settings[part], f"docs/settings_map.md names {part}.{field}, which is not a setting"
            if (part, field) in CHOICES and value.startswith("'"):
                known = sorted(CHOICES[part, field])
                assert value.strip("'") in known, f"{part}.{field} = {value}: not one of {known}"
    assert bound >= 50


def test_the_check_catches_a_setting_that_does_not_exist(tmp_path, monkeypatch):
    fake = tmp_path / "map.md"
    fake.write_text(MAP.read_text().replace("`RolloutConfig.group_size = 8`", "`RolloutConfig.n = 8`")
                    .replace("`LearnerConfig.loss_name = 'gspo'`", "`LearnerConfig.loss_name = 'gspo_seq'`"))
    monkeypatch.setitem(globals(), "MAP", fake)
    try:
        test_every_binding_in_the_map_is_a_real_setting_and_choice()
    except AssertionError as e:
        assert "RolloutConfig.n" in str(e)
    else:
        raise AssertionError("a binding to a setting that does not exist passed")
