"""The fault drill's grader (a module of its own, so the grader pool's spawned workers import it by name): the
answer "hang" blocks the alarm and sleeps (only the parent's hard deadline ends it), "crash" kills the worker;
any other answer is graded as math."""

from __future__ import annotations

import os
import signal
import time

from rollverify_jax.data import rewards


def faulty_grader(response: str, answer: str) -> float:
    if answer == "hang":
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
        time.sleep(60)
    if answer == "crash":
        time.sleep(0.2)
        os._exit(3)
    return rewards.math_reward(response, answer)
