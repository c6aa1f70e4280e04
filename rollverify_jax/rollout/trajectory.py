"""One sampled response and what verification needs of each of its tokens, and the policy's view of it."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class PolicyView:
    """The tokens of a response the policy sampled (an environment's replies left out), in order: what
    verification and the learner's loss read. ``n`` = how many."""

    positions: np.ndarray  # int64[n]: their response positions
    logps: np.ndarray  # float32[n]: their log mu
    versions: np.ndarray  # int32[n]: the policy version that sampled each
    mask: np.ndarray  # bool[num_tokens]: True where the policy sampled the token, False on environment tokens

    def __len__(self) -> int:
        return len(self.positions)

    @property
    def has_env(self) -> bool:
        """Some response tokens are the environment's (the policy's are then not one prefix of the response)."""
        return len(self.positions) < len(self.mask)

    def response_index(self, k: int) -> int:
        """The response position of the policy's ``k``-th token: where a cut that keeps ``k`` of them lands
        (everything after it, later environment replies included, goes). The whole response when ``k >= n``."""
        return len(self.mask) if k >= len(self.positions) else int(self.positions[k])


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
    # [start, end) response positions the environment wrote (e.g. tool replies), in order: the policy did not
    # sample them, so they carry no log mu (0.0), stay out of the OPS, verification and the loss (``policy_view``),
    # and a cut never lands on one. Empty for a single-turn trajectory.
    env_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tool_calls(self) -> int:
        """Environment replies so far (in tool use, calls answered: each reply is one environment span)."""
        return len(self.env_spans)

    @property
    def turn_start(self) -> int:
        """The response position where the policy's current turn began (after the last environment reply)."""
        return self.env_spans[-1][1] if self.env_spans else 0

    def policy_mask(self) -> np.ndarray:
        """bool[num_tokens]: True where the policy sampled the token, False on environment replies."""
        mask = np.ones((len(self.tokens),), bool)
        for start, end in self.env_spans:
            mask[start:end] = False
        return mask

    def policy_view(self) -> PolicyView:
        """The policy's own tokens with their log mu and versions: the one place that reads ``env_spans`` for
        verification and the learner's batch."""
        mask = self.policy_mask()
        positions = np.flatnonzero(mask)
        logps, versions = np.asarray(self.logps, np.float32), np.asarray(self.versions, np.int32)
        if self.env_spans:
            logps, versions = logps[positions], versions[positions]
        return PolicyView(positions, logps, versions, mask)

    def append_env(self, tokens: list[int], version: int) -> None:
        """Appends an environment reply: tokens the policy reads but did not sample (log mu 0.0, outside every
        OPS)."""
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

    def truncate(self, keep: int, fresh_draw: bool = True) -> None:
        """Keeps y_1..y_keep (with their original log mu and versions); a cut trajectory is unfinished and
        regenerates its suffix with a new draw (``fresh_draw``; the coupled verification rule keeps the key
        stream instead: its cut is where the new policy's sample with the same keys departs)."""
        if keep < len(self.tokens):
            del self.tokens[keep:], self.logps[keep:], self.versions[keep:]
            self.env_spans = [(a, min(b, keep)) for a, b in self.env_spans if a < keep]
            self.finished = False
            self.draws += int(fresh_draw)

    def to_dict(self) -> dict:
        """The trajectory as plain values and arrays (a checkpoint's paused cache, ``rl.buffer``)."""
        return {
            "uid": self.uid, "group_id": self.group_id, "prompt": np.asarray(self.prompt, np.int32), "seed": self.seed,
            "max_new_tokens": self.max_new_tokens, "tokens": np.asarray(self.tokens, np.int32),
            "logps": np.asarray(self.logps, np.float32), "versions": np.asarray(self.versions, np.int32),
            "finished": bool(self.finished), "draws": self.draws, "meta": self.meta, "history": self.history,
            "env_spans": [[int(a), int(b)] for a, b in self.env_spans],
        }

    @classmethod
    def from_dict(cls, d: dict) -> Trajectory:
        return cls(
            uid=int(d["uid"]), group_id=int(d["group_id"]), prompt=np.asarray(d["prompt"], np.int32),
            seed=int(d["seed"]), max_new_tokens=int(d["max_new_tokens"]),
            tokens=[int(x) for x in np.asarray(d["tokens"]).reshape(-1)],
            logps=[float(x) for x in np.asarray(d["logps"], np.float32).reshape(-1)],
            versions=[int(x) for x in np.asarray(d["versions"]).reshape(-1)],
            finished=bool(d["finished"]), draws=int(d.get("draws", 0)), meta=dict(d.get("meta") or {}),
            history=[dict(e) for e in d.get("history") or []],  # absent in checkpoints of earlier versions
            env_spans=[(int(a), int(b)) for a, b in d.get("env_spans") or []],  # likewise (single-turn: none)
        )
