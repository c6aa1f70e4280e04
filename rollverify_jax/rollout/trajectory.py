"""One sampled response and what verification needs of each of its tokens."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Trajectory:
    """One sample of one prompt: its response so far and what verification needs per token."""

    uid: int
    group_id: int
    prompt: np.ndarray  # int32[P]
    seed: int
    max_new_tokens: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logps: list[float] = dataclasses.field(default_factory=list)  # log mu(y_t)
    versions: list[int] = dataclasses.field(default_factory=list)  # v_t
    finished: bool = False
    draws: int = 0  # verification cuts so far: each cut starts a fresh draw of the suffix
    meta: dict = dataclasses.field(default_factory=dict)
    # What happened to it between phases, oldest first: {"event": "pause", "version", "tokens"} when a phase
    # ended with it unfinished, {"event": "verify", "version", "kept", "of"} when a resume verified it.
    history: list[dict] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def sample_seed(self) -> int:
        """The seed of the current draw. Token t is sampled with key (sample_seed, t), so a resume after
        preemption (no cut) reproduces its samples, while a suffix regenerated after a cut is a fresh draw
        from the current policy, not a replay of the removed tokens' randomness."""
        if self.draws == 0:
            return self.seed
        return int(np.random.SeedSequence([self.seed, self.draws]).generate_state(1)[0])

    def truncate(self, keep: int) -> None:
        """Keeps y_1..y_keep (with their original log mu and versions); a cut trajectory is unfinished and
        regenerates its suffix with a new draw."""
        if keep < len(self.tokens):
            del self.tokens[keep:], self.logps[keep:], self.versions[keep:]
            self.finished = False
            self.draws += 1
