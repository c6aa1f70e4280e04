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
    # [start, end) response positions the environment wrote (tool replies), in order: the policy did not sample
    # them, so they carry no log mu (0.0), stay out of the OPS, verification and the loss, and a cut never lands
    # on one. Empty for a single-turn trajectory.
    env_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tool_calls(self) -> int:
        """Tool calls answered so far (each reply is one environment span)."""
        return len(self.env_spans)

    def policy_mask(self) -> np.ndarray:
        """bool[num_tokens]: True where the policy sampled the token, False on tool replies."""
        mask = np.ones((len(self.tokens),), bool)
        for start, end in self.env_spans:
            mask[start:end] = False
        return mask

    def append_env(self, tokens: list[int], version: int) -> None:
        """Appends a tool reply: tokens the policy reads but did not sample (log mu 0.0, outside every OPS)."""
        if tokens:
            self.env_spans.append((len(self.tokens), len(self.tokens) + len(tokens)))
            self.tokens.extend(tokens)
            self.logps.extend([0.0] * len(tokens))
            self.versions.extend([version] * len(tokens))

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
            self.env_spans = [(a, min(b, keep)) for a, b in self.env_spans if a < keep]
            self.finished = False
            self.draws += 1
