"""Whether a training run may begin at step 0 in its workdir: not when the workdir shows a run was there.

With no checkpoint to restore a run starts over, and ``MetricsWriter`` drops every metric row. That is right for
a new workdir (or one whose only row is the step-0 evaluation of a launch killed before its first step), and
wrong when the checkpoints went missing or were all set aside as damaged: the history would be wiped with no one
asked. Such a workdir is refused (one line naming what was found, exit 2) unless
``TrainConfig.restart_from_scratch`` (``--restart_from_scratch``) says to start over; the old ``metrics.jsonl`` is
then kept beside the new one.
"""

from __future__ import annotations

import sys

from etils import epath

from rollverify_jax.infra import distributed, storage
from rollverify_jax.run.checkpoint import Checkpointer
from rollverify_jax.run.metrics import METRICS_FILE, read_metrics


def history(workdir: epath.Path, checkpointer: Checkpointer) -> list[str]:
    """What in ``workdir`` says a run trained there: metric rows of training steps, step directories set aside."""
    found = []
    if (workdir / METRICS_FILE).exists():
        steps = [int(r["step"]) for r in read_metrics(workdir / METRICS_FILE) if int(r.get("step", 0)) > 0]
        if steps:
            found.append(f"{METRICS_FILE} has {len(steps)} rows of training steps (up to step {max(steps)})")
    aside = checkpointer.set_aside_steps()
    if aside:
        found.append(f"checkpoints/ holds {', '.join(aside)} (set aside: damaged or never committed)")
    return found


def check_fresh_start(workdir: storage.PathLike, checkpointer: Checkpointer, allow: bool) -> None:
    """Raises ValueError when ``workdir`` has no checkpoint to restore but a run's history (``history``), unless
    ``allow``; then warns, and keeps the old metrics file as ``metrics.before_restart[-n].jsonl``. Every host
    gets the same outcome."""
    workdir = storage.as_path(workdir)
    found = history(workdir, checkpointer) if distributed.is_main_process() else []
    if not distributed.gather_ints([bool(found)])[0, 0]:
        return
    where = storage.absolute(workdir)
    if not allow:
        detail = "; ".join(found) if found else "see process 0's log"
        raise ValueError(f"{where} has no checkpoint that can be restored, but a run was there: {detail}. Starting "
                         "over would drop its history. Look at what happened to the checkpoints (another workdir? "
                         "a damaged disk?), or pass --restart_from_scratch to start at step 0 anyway.")
    if distributed.is_main_process():
        kept = _keep_old_metrics(workdir)
        print(f"warning: --restart_from_scratch: starting {where} at step 0 although {'; '.join(found)}"
              + (f"; the old metrics are kept as {kept}" if kept else ""), file=sys.stderr, flush=True)


def _keep_old_metrics(workdir: epath.Path) -> str | None:
    path = workdir / METRICS_FILE
    if not path.exists():
        return None
    target, n = workdir / "metrics.before_restart.jsonl", 0
    while target.exists():
        n += 1
        target = workdir / f"metrics.before_restart-{n}.jsonl"
    path.rename(target)
    return target.name
