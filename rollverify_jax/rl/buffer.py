"""The paused-trajectory cache with group bookkeeping (METHOD.md section 5).

A group is the G samples of one prompt. Its advantage needs all G rewards, so finished members of a group
whose other members are still running wait here; by default they are re-verified with the paused ones at
every resume (a cut one becomes unfinished again). Everything here round-trips through a checkpoint.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rollverify_jax.rollout.trajectory import Trajectory
from rollverify_jax.verify.ops import trajectory_staleness


@dataclasses.dataclass
class Group:
    group_id: int
    size: int
    record: dict  # the prompt record: {"prompt": str, "answer": str, ...}
    finished: dict[int, Trajectory] = dataclasses.field(default_factory=dict)  # uid -> trajectory

    @property
    def complete(self) -> bool:
        return len(self.finished) == self.size


class PausedCache:
    """Paused (unfinished) trajectories plus the groups they belong to."""

    def __init__(self):
        self.groups: dict[int, Group] = {}
        self.paused: list[Trajectory] = []

    def __len__(self) -> int:
        return len(self.paused)

    def add_group(self, group: Group) -> None:
        self.groups[group.group_id] = group

    def add_finished(self, traj: Trajectory) -> None:
        self.groups[traj.group_id].finished[traj.uid] = traj

    def pop_complete(self, limit: int | None = None) -> list[Group]:
        """Complete groups, oldest first (at most ``limit``); they leave the cache."""
        ids = sorted(g for g, grp in self.groups.items() if grp.complete)[:limit]
        return [self.groups.pop(g) for g in ids]

    def num_complete(self) -> int:
        return sum(g.complete for g in self.groups.values())

    def pause(self, trajectories: list[Trajectory]) -> None:
        self.paused.extend(trajectories)

    def take_for_resume(self, include_finished: bool) -> list[Trajectory]:
        """Everything to resume: paused first, then, when finished members are re-verified, every finished
        member still cached, of incomplete groups and of complete groups carried beyond a batch's B alike (a
        carried group trains under a newer policy than the one it was verified against, so it is verified
        again; a member that survives goes straight back to its group without decoding)."""
        out, self.paused = self.paused, []
        if include_finished:
            for gid in sorted(self.groups):
                out.extend(self.groups[gid].finished.values())
                self.groups[gid].finished = {}
        return out

    def staleness(self, current_version: int) -> np.ndarray:
        """current version - oldest token version, per cached trajectory holding tokens (paused + waiting)."""
        trajs = self.paused + [t for g in self.groups.values() for t in g.finished.values()]
        return trajectory_staleness(current_version, [t.versions for t in trajs if t.versions])

    # ------------------------------------------------------------------------------------------------
    # Checkpointing: plain dicts of lists / arrays (float32 log-probs stay exact).

    def to_dict(self) -> dict:
        return {
            "paused": [t.to_dict() for t in self.paused],
            "groups": [
                {"group_id": g.group_id, "size": g.size, "record": g.record,
                 "finished": [t.to_dict() for t in g.finished.values()]}
                for g in self.groups.values()
            ],
        }

    @classmethod
    def from_dict(cls, d: dict) -> PausedCache:
        cache = cls()
        cache.paused = [Trajectory.from_dict(t) for t in d["paused"]]
        for g in d["groups"]:
            group = Group(int(g["group_id"]), int(g["size"]), dict(g["record"]))
            for t in g["finished"]:
                traj = Trajectory.from_dict(t)
                group.finished[traj.uid] = traj
            cache.groups[group.group_id] = group
        return cache
