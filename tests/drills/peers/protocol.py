"""The workers' side of bench_peers.py's protocol: one JSON object per line on stdin (a command), one per line on
stdout (its reply). Standard library only: it runs in every peer's own environment.

A worker's stdout is the protocol channel alone: anything a library prints goes to stderr (fd 1 is pointed there
before any library is imported), so a stray print cannot corrupt a reply.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable

_CHANNEL = None


def claim_stdout() -> None:
    """Keeps the real stdout for replies and sends everything else written to fd 1 to stderr."""
    global _CHANNEL
    if _CHANNEL is None:
        _CHANNEL = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr


def reply(obj: dict) -> None:
    _CHANNEL.write(json.dumps(obj) + "\n")
    _CHANNEL.flush()


def serve(handlers: dict[str, Callable[..., dict]]) -> None:
    """Answers commands ``{"cmd": name, **kwargs}`` with ``{"ok": true, **handler(**kwargs)}`` (or
    ``{"ok": false, "error": traceback}``) until ``quit`` or the end of stdin."""
    claim_stdout()
    reply({"ok": True, "event": "started", "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        cmd = msg.pop("cmd")
        if cmd == "quit":
            reply({"ok": True})
            return
        try:
            reply({"ok": True, **handlers[cmd](**msg)})
        except Exception:  # reported to the controller, which stops the benchmark with it
            reply({"ok": False, "error": traceback.format_exc()})


def eos_cut(tokens, eos_ids) -> list[int]:
    """The response up to and including its first EOS (all of it when it has none)."""
    out = []
    for t in tokens:
        out.append(int(t))
        if int(t) in eos_ids:
            break
    return out


def generation_result(seconds: float, responses: list[list[int]], max_new: int, eos: bool,
                      return_tokens: bool) -> dict:
    """A peer worker's ``generate`` reply; fixed-length runs (``eos`` off) must give exactly ``max_new`` tokens."""
    lengths = [len(r) for r in responses]
    if not eos and any(n != max_new for n in lengths):
        raise RuntimeError(f"fixed-length rows of {sorted(set(lengths))} tokens, expected {max_new}")
    out = {"seconds": seconds, "tokens": sum(lengths), "lengths": lengths}
    if return_tokens:
        out["responses"] = responses
    return out
