"""The scheduler's counters, in a module of their own so an environment can read them without importing the
scheduler (which imports environments)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RolloutStats:
    """Counters since the last ``reset``; slot utilization = useful token-steps / (slots x decode steps)."""

    dispatches: int = 0
    decode_steps: int = 0  # steps of the decode dispatches read (their tokens reached the trajectories)
    # Steps of dispatches never read: with dispatch_ahead, the one in flight at a pause (or when the work ran out),
    # which the device ran for nothing. Apart from decode_steps, which stays the steps that produced tokens (what
    # the replay counts, and what slot utilization and the tool wait fraction divide by).
    decode_steps_dropped: int = 0
    useful_token_steps: int = 0
    tokens_generated: int = 0
    prefill_sequences: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0  # tokens computed by prefill dispatches
    shared_prompt_tokens: int = 0  # prompt tokens of a group's members copied from one prefill, not recomputed
    prefill_time: float = 0.0  # prefill + insert dispatches (includes waiting for the device)
    decode_time: float = 0.0  # generate dispatches (includes waiting for the device)
    host_time: float = 0.0  # scheduler bookkeeping outside device dispatches
    # Regenerated tokens (sampled where a verification cut removed a token) and how many equal the removed one:
    # a diagnostic of whether regeneration is a fresh draw (it is when the rate matches fresh samples').
    regen_tokens: int = 0
    regen_equal: int = 0
    # Cached tokens the coupled rule kept only by VerifyConfig.coupled_tolerance (the current params, with their
    # noise, would have drawn another token within that margin): 0 when the kept prefixes are exact samples.
    near_ties_kept: int = 0
    parked_slot_steps: int = 0  # slots x decode steps spent holding a trajectory that waits for a reply
    reply_blocked_time: float = 0.0  # seconds spent waiting for environment replies, decoding nothing meanwhile
    extend_tokens: int = 0  # tokens appended to parked slots (environment replies), never a re-prefill

    def slot_utilization(self, num_slots: int) -> float:
        return self.useful_token_steps / max(1, num_slots * self.decode_steps)
