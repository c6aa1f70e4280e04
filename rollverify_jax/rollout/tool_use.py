"""Multi-turn tool use in the rollout (ReTool-style), as one ``Environment`` (``rollout/environment.py``): when a
policy turn ends at a tool call's closing token, the call is parsed from that turn's text, run off the decode loop
(a thread pool: the calculator is in process, the python tool a sandboxed subprocess), and its reply comes back as
tokens the policy reads but did not sample: the tool's output is encoded as plain text (a special token it prints is
its characters, never the special id), the reply's frame as markup.

A call's time limit counts its own run only, never its wait for a worker: the sandbox's own timeout result (with
what the program printed) is what the policy reads, whatever the load on the pool.

The scheduler owns the slots and parks one while its environment works; this module owns what happens between a
turn's end and the reply's tokens. Each environment builds its own tools (``tools.builtin_tools``, the python
tool with the run's ``SandboxConfig``): nothing is registered globally. JAX-free, so the rule that decides what a
reply looks like is testable on its own.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from rollverify_jax.infra.daemon_pool import DaemonThreadPool
from rollverify_jax.rollout.environment import Environment, Request
from rollverify_jax.rollout.trajectory import Trajectory
from rollverify_jax.tools import (
    SandboxConfig,
    ToolRegistry,
    ToolResult,
    ToolStatus,
    builtin_tools,
    format_tool_output,
    parse_tool_call,
)
from rollverify_jax.tools import sandbox as sandbox_lib

if TYPE_CHECKING:
    from rollverify_jax.rollout.stats import RolloutStats

CLOSE_WAIT_S = 2.0  # how long close() waits for the tool calls running at a run's end


@dataclasses.dataclass(frozen=True)
class ToolUseConfig:
    """Multi-turn tool use in the rollout (off by default: one prompt, one sampled response).

    call_end_token: the one token that closes a tool call (e.g. Qwen3's ``</tool_call>``, the tiny tool policy's
    ``</calculator>``); decoding stops there, the call is parsed from the turn (``parse_tool_call``: the
    ``<tool_call>NAME ...</tool_call>`` or ``<NAME>...</NAME>`` forms) and run. The reply the policy reads is
    ``reply_prefix + output + reply_suffix`` (for Qwen3's chat format the prefix closes the assistant turn and
    opens a tool turn, the suffix opens the next assistant turn), at most ``max_reply_tokens`` tokens of output.
    max_calls: tool calls per trajectory; a call past it ends the trajectory. timeout_s: a call's wall-clock
    limit, counted from when it starts running (never its wait for a worker): the python tool's sandbox wall clock
    (its other limits are ``SandboxConfig``), whose timeout reply keeps what the program printed; a tool still
    running 5 s past it (``OVERRUN_S``) gets the environment's timeout reply, never a stuck slot.
    workers: calls running at once (None: one per CPU core this process may use: a sandboxed program is
    CPU-bound, more at once would only slow each down). A call beyond them waits for a worker, in order; the
    scheduler holds at most one open call per engine slot, so the wait is bounded (slots / workers runs).
    reply_dispatches: a call's reply joins its trajectory before the ``reply_dispatches``-th decode dispatch
    after the call (the scheduler waits for it there, up to its timeout; ``Environment.reply_dispatches``): 1
    suits a tool that answers in microseconds (the calculator: its slot sits out no dispatch), more lets a slow
    tool (the python sandbox) overlap that many dispatches minus one instead of holding up the next. Counted in
    dispatches, so which dispatch a reply joins is the same in every run."""

    enabled: bool = False
    tools: tuple[str, ...] = ("calculator",)
    call_end_token: str = "</tool_call>"
    reply_prefix: str = "<tool_response>"
    reply_suffix: str = "</tool_response>"
    max_calls: int = 4
    max_reply_tokens: int = 256
    timeout_s: float = 10.0
    workers: int | None = None
    reply_dispatches: int = 1

    def __post_init__(self):
        if not self.tools:
            raise ValueError("ToolUseConfig.tools is empty: name at least one tool, e.g. ('calculator',).")
        for name in ("max_calls", "max_reply_tokens", "workers", "reply_dispatches"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"ToolUseConfig.{name}={getattr(self, name)} must be >= 1.")
        if not self.timeout_s > 0:
            raise ValueError(f"ToolUseConfig.timeout_s={self.timeout_s} must be > 0.")


# A call still running this long past its timeout_s gets the environment's timeout reply. The sandbox answers its
# own timeout (with the program's output so far) within about 4 s of it (its stop and reaping, docs/tools.md), so
# that reply is the one the policy reads; this deadline is for a tool that never returns.
OVERRUN_S = 5.0


@dataclasses.dataclass
class ToolStats:
    calls: int = 0
    errors: int = 0  # timeouts, tool errors, calls that did not parse
    timeouts: int = 0  # the tool's own (the sandbox's) and the environment's
    seconds: float = 0.0  # summed wall-clock of the calls' runs (they overlap each other and decoding)
    queue_wait_s: float = 0.0  # summed wait of the calls for a worker, before they ran


@dataclasses.dataclass
class _Call:
    """When a call was submitted and when a worker started running it (``time.perf_counter``; None while it waits
    for a worker): its time limit counts from the second."""

    submitted: float
    running: float | None = None


@dataclasses.dataclass
class ToolRequest(Request):
    """A tool call's request: the scheduler's ``Request`` and the call's own clock."""

    call: _Call


class ToolEnvironment(Environment):
    """Runs the tool calls of a rollout: ``request`` submits a trajectory's last call, ``reply`` reads its reply
    tokens once done. Every fault (no parsable call, unknown tool, timeout, crash, huge output) becomes a short
    error reply the policy reads.

    encode: the reply's frame (``reply_prefix``, ``reply_suffix``: markup, its special tokens one id each);
    encode_text: a tool's output, as plain text (a special token in it is its characters; default ``encode``,
    for a codec without special tokens). sandbox: the python tool's limits (default ``SandboxConfig()``), its
    wall clock being ``config.timeout_s``. registry: the tools calls may reach (default: the built-in ones of
    ``config.tools``, built for this environment); the environment's own, shared with no other."""

    def __init__(self, config: ToolUseConfig, encode: Callable[[str], list[int]],
                 decode: Callable[[Sequence[int]], str], call_end_id: int, sandbox: SandboxConfig | None = None,
                 registry: ToolRegistry | None = None, encode_text: Callable[[str], list[int]] | None = None):
        self.config = config
        self.encode, self.decode = encode, decode
        self.encode_text = encode_text or encode
        self.call_end_id = int(call_end_id)
        self.reply_dispatches = config.reply_dispatches
        self.stats = ToolStats()
        if registry is None:  # an unknown name fails here, naming the known ones
            sandbox = dataclasses.replace(sandbox or SandboxConfig(), timeout_s=config.timeout_s)
            registry = builtin_tools(config.tools, sandbox)
        for name in config.tools:
            registry.get(name)
        self.registry = registry
        self.overrun_s = OVERRUN_S
        self._pool = DaemonThreadPool(config.workers or _cores(), "tool")  # a stuck call never holds up the exit

    @classmethod
    def for_tokenizer(cls, config: ToolUseConfig, tokenizer, sandbox: SandboxConfig | None = None) -> ToolEnvironment:
        """An environment over ``tokenizer`` (``models.tokenizer.Tokenizer``); the call-end token must be one of
        its tokens, else decoding could never stop at it. A tool's output is encoded as plain text
        (``Tokenizer.encode(..., plain_text=True)``): a special token it holds never becomes its id."""
        try:
            end = tokenizer.token_id(config.call_end_token)
        except (KeyError, ValueError):
            raise ValueError(f"ToolUseConfig.call_end_token={config.call_end_token!r} is not one token of the "
                             "policy's tokenizer: name the token its tool calls end with (Qwen3: '</tool_call>')."
                             ) from None
        return cls(config, tokenizer.encode, lambda ids: tokenizer.decode(ids, skip_special_tokens=False), end,
                   sandbox, encode_text=functools.partial(tokenizer.encode, plain_text=True))

    def ends_call(self, t: Trajectory) -> bool:
        """The trajectory's last token closes a tool call the policy wrote (not one quoted in a reply)."""
        return bool(t.tokens) and t.tokens[-1] == self.call_end_id and t.turn_start < t.num_tokens

    def can_reply(self, t: Trajectory) -> bool:
        """Within the budget: calls left, and room for a reply and one more policy token."""
        return t.tool_calls < self.config.max_calls and t.num_tokens < t.max_new_tokens - 1

    def awaits_reply(self, t: Trajectory) -> bool:
        """An unfinished trajectory that stopped at a tool call within its budget: the reply comes next."""
        return not t.finished and self.ends_call(t) and self.can_reply(t)

    def ends(self, t: Trajectory) -> bool:
        """A tool call past the budget: no reply can follow, the trajectory ends at its closing tag."""
        return self.ends_call(t) and not self.can_reply(t)

    def request(self, t: Trajectory) -> ToolRequest:
        """Submits the call that ends ``t``'s current turn (the text since the last reply)."""
        text = self.decode(t.tokens[t.turn_start:])
        call = _Call(time.perf_counter())
        return ToolRequest(self._pool.submit(self._start, call, text), call)

    def _start(self, call: _Call, text: str) -> tuple[ToolResult, float]:
        """A worker runs the call: its clock starts here."""
        call.running = time.perf_counter()
        return self._run(text)

    def _run(self, text: str) -> tuple[ToolResult, float]:
        t0 = time.perf_counter()
        call = parse_tool_call(text, names=self.config.tools)
        if call is None:
            result = ToolResult("", ToolStatus.ERROR, 0.0, "no tool call found before the closing tag")
        elif call[0] not in self.config.tools:
            result = ToolResult("", ToolStatus.ERROR, 0.0,
                                f"unknown tool {call[0]!r}; available: {', '.join(self.config.tools)}")
        else:
            result = self.registry.call(*call)
        return result, time.perf_counter() - t0

    def reply(self, request: ToolRequest, room: int) -> list[int]:
        """The reply's tokens, at most ``room`` of them (the reply's frame is kept whole and the output cut first),
        waiting for the call: for a worker first (a bounded wait: one open call per slot), then for its run, the
        tool's own result, its own timeout included; a tool still running ``overrun_s`` past ``timeout_s`` of its
        run gets the environment's timeout reply (the same text every time)."""
        call, limit = request.call, self.config.timeout_s + self.overrun_s
        while True:
            running = call.running
            wait = 0.05 if running is None else max(0.0, running + limit - time.perf_counter())
            try:
                result, seconds = request.future.result(timeout=wait)
                break
            except concurrent.futures.TimeoutError:
                if running is None:  # still waiting for a worker: its clock has not started
                    continue
                request.cancel()  # a thread cannot be killed: its result, when it comes, is dropped
                seconds = time.perf_counter() - running
                result = ToolResult("", ToolStatus.TIMEOUT, seconds, f"the call ran past {self.config.timeout_s:g} s")
                break
        self.stats.calls += 1
        self.stats.errors += result.status in (ToolStatus.ERROR, ToolStatus.TIMEOUT)
        self.stats.timeouts += result.status == ToolStatus.TIMEOUT
        self.stats.seconds += seconds
        self.stats.queue_wait_s += call.running - call.submitted
        return self.reply_tokens(result, room)

    def reply_tokens(self, result: ToolResult, room: int) -> list[int]:
        prefix, suffix = self.encode(self.config.reply_prefix), self.encode(self.config.reply_suffix)
        body = self._encode_leniently(format_tool_output(result, tag=""))  # plain text: no special id
        body = body[: max(0, min(self.config.max_reply_tokens, room - len(prefix) - len(suffix)))]
        return (prefix + body + suffix)[:room]

    def _encode_leniently(self, text: str) -> list[int]:
        """A tool's output may hold characters a small vocabulary lacks (the tiny policies' tokenizers are
        character-level): those are dropped, never a crash of the rollout."""
        try:
            return self.encode_text(text)
        except ValueError:
            out = []
            for c in text:
                try:
                    out += self.encode_text(c)
                except ValueError:
                    continue
            return out

    def phase_metrics(self, batch: Sequence[Trajectory], wall: float, stats: RolloutStats,
                      num_slots: int) -> dict:
        """The batch's calls and turns per trajectory, the phase's calls, errors, timeouts, tool seconds (their
        share of the phase's wall-clock; calls overlap decoding and each other) and mean wait for a worker, the
        share of slot-steps spent holding a trajectory whose call runs, and the time the rollout waited for
        replies (decoding nothing meanwhile)."""
        calls = np.asarray([t.tool_calls for t in batch], np.float64)
        return {
            "tools/calls_per_trajectory": float(calls.mean()) if calls.size else 0.0,
            "tools/turns_mean": float(calls.mean()) + 1.0 if calls.size else 0.0,
            "tools/calls": self.stats.calls,
            "tools/errors": self.stats.errors,
            "tools/timeouts": self.stats.timeouts,
            "tools/time_share": self.stats.seconds / max(wall, 1e-9),
            "tools/queue_wait_s": self.stats.queue_wait_s / max(1, self.stats.calls),
            "tools/blocked_time": stats.reply_blocked_time,
            "rollout/tool_wait_fraction": stats.parked_slot_steps / max(1, num_slots * stats.decode_steps),
            "rollout/extend_tokens": stats.extend_tokens,
        }

    def reset_stats(self) -> None:
        self.stats = ToolStats()

    def close(self) -> None:
        """At a run's end: the calls not started are cancelled and the python tool's running sandboxes stopped
        (nothing reads their replies now); the pool's threads are waited for at most ``CLOSE_WAIT_S``. A call
        stuck in an in-process tool past it is left to its daemon thread, which does not hold up the exit."""
        stuck = self._pool.shutdown(CLOSE_WAIT_S, interrupt=sandbox_lib.stop_running)
        if stuck:
            print(f"warning: {len(stuck)} tool call(s) still running {CLOSE_WAIT_S:g} s after the run's end were "
                  "left behind (an in-process tool that does not return)", file=sys.stderr, flush=True)


def _cores() -> int:
    """CPU cores this process may run on (its affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
