"""Reward functions written for rollverify, verl or TRL, loaded from a module or a file and called the way each
framework calls them.

Three calling conventions, told apart by the function's parameter names (as verl and TRL call theirs by keyword):

* rollverify: ``fn(response: str, answer: str) -> float``;
* verl: ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` returning a number or a dict
  whose ``"score"`` is the reward (verl's own reward files return either); ``extra_info`` is passed when the
  function takes it;
* TRL: ``fn(prompts, completions, **kwargs) -> list[float]``, the dataset's columns as keyword lists. It is called
  once per response with lists of length 1, so every response keeps its own timeout in the grader pool (and a
  hang costs one item, not the batch). The columns: ``answer`` and ``ground_truth`` (the gold answer),
  ``data_source``, ``extra_info``, and each key of ``extra_info`` as a column of its own (a MATH record's
  ``solution``, as TRL's ``accuracy_reward`` reads it). A record with ``messages`` is conversational, as TRL
  treats a chat dataset: ``prompts`` holds the messages and each completion is ``[{"role": "assistant",
  "content": ...}]``; otherwise both are strings.

What the reward sees of a multi-turn (tool-using) trajectory: the decoded response, tool calls and replies
included, and in ``extra_info`` verl's ``num_turns`` and the number of ``tool_calls`` (``with_interaction``); a
single-turn run's rewards see what they always saw.

A name ``'package.module:function'`` imports the module; ``'/path/to/file.py:function'`` (verl's
``custom_reward_function.path`` and ``.name``; a bare ``'/path/to/file.py'`` means ``compute_score``) loads the
file. A function defined in a file cannot be pickled by reference into spawned workers, so ``FileFunction``
carries the path and the name and loads the file on first call in each process. The signature is checked once,
up front, with one message that shows the three accepted forms.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

STYLES = ("rollverify", "verl", "trl")
UNKNOWN_SOURCE = "unknown"  # the data_source of a record that names none (the synthetic task's, old checkpoints')
_POSITIONAL = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_FORMS = ("(response: str, answer: str) -> float, or be verl's compute_score(data_source, solution_str, "
          "ground_truth, extra_info=None) -> float | dict, or a TRL reward function (prompts, completions, "
          "**kwargs) -> list[float]")


def data_source_of(record: Mapping[str, Any] | None) -> str:
    """A record's ``data_source``, or ``UNKNOWN_SOURCE`` for one that names none."""
    value = record.get("data_source") if record is not None else None
    return value if isinstance(value, str) and value else UNKNOWN_SOURCE


# -- multi-turn records and what their reward sees ----------------------------------------------------------

# The agent loops a record may name in verl's top-level ``agent_name`` column (verl registers them under these
# names: verl/experimental/agent_loop/single_turn_agent_loop.py, tool_agent_loop.py): one response, or a response
# with tool calls and their replies in it.
SINGLE_TURN_AGENT = "single_turn_agent"
TOOL_AGENT = "tool_agent"
AGENTS = (SINGLE_TURN_AGENT, TOOL_AGENT)
# extra_info keys of verl's multi-turn files (tool arguments per row, the interaction's arguments, and the flag
# that says the row needs tool arguments): a row that names no agent but carries one of them is a tool agent's
# (verl's gsm8k_multiturn_w_tool.py writes them without agent_name; its rollout turned multi-turn on globally).
MULTI_TURN_KEYS = ("tools_kwargs", "need_tools_kwargs", "interaction_kwargs")


def agent_of(record: Mapping[str, Any] | None) -> str:
    """The agent loop a record asks for: its ``agent_name``; without one, ``TOOL_AGENT`` when its extra_info holds
    tool or interaction arguments (``MULTI_TURN_KEYS``, set and not empty), else ``SINGLE_TURN_AGENT``."""
    if record is None:
        return SINGLE_TURN_AGENT
    name = record.get("agent_name")
    if isinstance(name, str) and name:
        return name
    extra = record.get("extra_info")
    if isinstance(extra, Mapping) and any(extra.get(key) for key in MULTI_TURN_KEYS):
        return TOOL_AGENT
    return SINGLE_TURN_AGENT


def interaction_turns(env_spans: Sequence[tuple[int, int]], num_tokens: int) -> tuple[int, int]:
    """(num_turns, tool_calls) of a response whose ``env_spans`` ([start, end) positions) the environment wrote.

    ``num_turns`` is verl's count (verl/experimental/agent_loop/tool_agent_loop.py: ``user_turns +
    assistant_turns + 1``): the prompt, plus each stretch the policy generated (an assistant turn, at least one),
    plus each round of tool replies (a user turn; replies that follow each other with nothing generated between
    them answer calls made together and count once). A single-turn response is 2, as verl's
    single_turn_agent_loop.py says; one tool call answered and a final answer is 4. ``tool_calls`` is the number of
    replies appended (one per answered call)."""
    rounds: list[list[int]] = []
    for start, end in sorted((int(a), int(b)) for a, b in env_spans):
        if rounds and start <= rounds[-1][1]:
            rounds[-1][1] = max(rounds[-1][1], end)
        else:
            rounds.append([start, end])
    generated, pos = 0, 0
    for start, end in rounds:
        generated += start > pos
        pos = max(pos, end)
    generated += num_tokens > pos
    return 1 + max(generated, 1) + len(rounds), len(env_spans)


def with_interaction(record: Mapping[str, Any], env_spans: Sequence[tuple[int, int]], num_tokens: int,
                     multi_turn: bool = False) -> Mapping[str, Any]:
    """The record a trajectory's reward sees. In a multi-turn rollout (``multi_turn``: tools on for every record),
    for a tool agent's record (``agent_of``) or for a response that called a tool: a copy whose ``extra_info`` adds
    ``num_turns`` and ``tool_calls`` (``interaction_turns``), as verl's reward managers add ``num_turns``
    (verl/workers/reward_manager/naive.py sets ``extra_info["num_turns"]`` from the rollout's ``__num_turns__``;
    a value the file holds under these names is replaced, as there). Any other record is returned as it is, so a
    single-turn run's rewards see exactly what they saw before. The record itself (checkpointed with its group,
    hashed for resumes) is never changed."""
    if not (multi_turn or env_spans or agent_of(record) == TOOL_AGENT):
        return record
    num_turns, tool_calls = interaction_turns(env_spans, num_tokens)
    extra = record.get("extra_info")
    extra = dict(extra) if isinstance(extra, Mapping) else {}
    return {**record, "extra_info": {**extra, "num_turns": num_turns, "tool_calls": tool_calls}}


# -- loading --------------------------------------------------------------------------------------------------

_FILE_MODULES: dict[str, Any] = {}  # per process: a file loaded once, however many items call into it


@dataclasses.dataclass(frozen=True)
class FileFunction:
    """A function defined in a Python file, loaded on first call in each process (picklable: a path and a name)."""

    path: str
    name: str = "compute_score"

    def load(self) -> Callable[..., Any]:
        module = _FILE_MODULES.get(self.path)
        if module is None:
            if not os.path.isfile(self.path):
                raise FileNotFoundError(f"reward file not found: {self.path!r}")
            module_name = "rollverify_reward_" + hashlib.sha1(self.path.encode("utf-8")).hexdigest()[:12]
            spec = importlib.util.spec_from_file_location(module_name, self.path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module  # dataclasses and pickling inside the file look themselves up here
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(module_name, None)
                raise
            _FILE_MODULES[self.path] = module
        fn = getattr(module, self.name, None)
        if not callable(fn):
            raise AttributeError(f"{self.path} defines no function {self.name!r}")
        return fn

    def __call__(self, *args, **kwargs) -> Any:
        return self.load()(*args, **kwargs)


def is_plugin(name: str) -> bool:
    """A name that points outside the registry: ``'module:function'``, ``'file.py:function'`` or ``'file.py'``."""
    return ":" in name or name.endswith(".py")


def load_plugin(name: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(what the workers receive, the function itself, to inspect) of a plug-in name."""
    target, _, attr = name.rpartition(":") if ":" in name else (name, ":", "compute_score")
    if target.endswith(".py") or os.sep in target:
        fn = FileFunction(os.path.abspath(os.path.expanduser(target)), attr)
        try:
            return fn, fn.load()
        except AttributeError as e:
            raise ValueError(f"reward plug-in {name!r}: {e}") from None
        except Exception as e:  # noqa: BLE001  (the file's own error, whatever it is)
            raise ValueError(f"reward plug-in {name!r}: cannot load {fn.path!r} ({type(e).__name__}: {e})") from None
    try:
        module = importlib.import_module(target)
    except ImportError as e:
        raise ValueError(f"reward plug-in {name!r}: cannot import {target!r} ({e}); put its package on "
                         "PYTHONPATH or install it") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward plug-in {name!r}: module {target!r} has no function {attr!r}")
    return fn, fn


# -- calling conventions ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CallStyle:
    """How a reward function is called: its convention, the keywords it takes (None: any, it has ``**kwargs``)
    and, for TRL, the columns it cannot do without."""

    style: str = "rollverify"
    params: tuple[str, ...] | None = None
    required: tuple[str, ...] = ()


def call_style(fn: Callable[..., Any], name: str) -> CallStyle:
    """The convention ``fn`` follows, from its parameter names; a signature that fits none is a ValueError."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: trust them
        return CallStyle()
    params = sig.parameters
    names = tuple(n for n, p in params.items() if p.kind in _POSITIONAL)
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    try:
        if "completions" in params:  # TRL's name (its columns may be called anything, data_source included)
            required = tuple(n for n in names if params[n].default is inspect.Parameter.empty
                             and n not in ("prompts", "completions"))
            sig.bind(completions=[], **({"prompts": []} if "prompts" in params else {}), **{n: [] for n in required})
            return CallStyle("trl", None if open_kwargs else names, required)
        if {"solution_str", "ground_truth"} & set(params):  # verl's names: all three taken, by keyword
            sig.bind(data_source="", solution_str="", ground_truth="",
                     **({"extra_info": None} if "extra_info" in params or open_kwargs else {}))
            return CallStyle("verl", None if open_kwargs else names)
        sig.bind("response", "answer")
    except TypeError:
        raise ValueError(f"reward plug-in {name!r} must take {_FORMS}; it takes {sig}") from None
    return CallStyle()


def split_grade(value: Any) -> tuple[Any, dict[str, float]]:
    """(the reward, the numeric extras) of a grade: verl's ``compute_score`` returns a number, or a dict whose
    ``"score"`` is the reward and whose other numeric entries (e.g. ``acc``, ``pred`` lengths) are logged as
    ``reward/extra/<key>``."""
    if not isinstance(value, Mapping):
        return value, {}
    if "score" not in value:
        raise KeyError(f"a verl reward returned a dict without 'score' (keys: {sorted(map(str, value))})")
    extras = {}
    for key, item in value.items():
        if key != "score" and isinstance(item, int | float | np.number) and np.isfinite(float(item)):
            extras[str(key)] = float(item)
    return value["score"], extras


def trl_columns(answer: str, context: Mapping[str, Any]) -> dict[str, Any]:
    """The dataset columns a TRL reward function receives for one record (one value each, not yet lists)."""
    extra = context.get("extra_info")
    columns = {k: v for k, v in extra.items() if k not in ("prompts", "completions")} if isinstance(
        extra, Mapping) else {}
    columns.update(answer=answer, ground_truth=answer, data_source=context.get("data_source", UNKNOWN_SOURCE),
                   extra_info=extra)
    return columns


def missing_columns(style: CallStyle, answer: str, context: Mapping[str, Any]) -> list[str]:
    """The columns a TRL function needs that this record does not give it (none for other conventions)."""
    if style.style != "trl":
        return []
    columns = trl_columns(answer, context)
    return [n for n in style.required if n not in columns]


@dataclasses.dataclass(frozen=True)
class Grader:
    """A reward function and its convention: what the grader pool's workers receive, called as
    ``grader(response, answer, context)`` whatever the convention (``context``: the record's ``data_source``,
    ``extra_info``, ``prompt`` and ``messages``)."""

    fn: Callable[..., Any]
    style: CallStyle = CallStyle()

    def __call__(self, response: str, answer: str, context: Mapping[str, Any] | None = None) -> Any:
        if self.style.style == "rollverify":
            return self.fn(response, answer)
        context = context or {}
        if self.style.style == "verl":
            kwargs = {"data_source": context.get("data_source", UNKNOWN_SOURCE), "solution_str": response,
                      "ground_truth": answer, "extra_info": context.get("extra_info")}
            return self.fn(**self._taken(kwargs))  # a number or verl's dict: split_grade reads it
        return self._call_trl(response, answer, context)

    def _taken(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The keywords the function takes (all of them when it has ``**kwargs``)."""
        params = self.style.params
        return kwargs if params is None else {k: v for k, v in kwargs.items() if k in params}

    def _call_trl(self, response: str, answer: str, context: Mapping[str, Any]) -> Any:
        """One item as a batch of one: TRL's ``prompts`` / ``completions`` (conversational when the record has
        messages) and the columns as length-1 lists."""
        messages = context.get("messages")
        if messages is not None:
            prompts, completions = [list(messages)], [[{"role": "assistant", "content": response}]]
        else:
            prompts, completions = [context.get("prompt", "")], [response]
        columns = {k: [v] for k, v in trl_columns(answer, context).items()}
        scores = self.fn(**self._taken({"prompts": prompts, "completions": completions, **columns}))
        if isinstance(scores, str | bytes | Mapping) or not hasattr(scores, "__len__") or len(scores) != 1:
            raise TypeError(f"a TRL reward function returns one score per completion; for 1 completion it "
                            f"returned {scores!r:.80}")
        return scores[0]
