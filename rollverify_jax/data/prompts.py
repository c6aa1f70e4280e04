"""Prompts as the policy sees them: ``PromptRenderer`` turns a record into its prompt ids under the run's chat
settings, and ``load_prompts`` is a dataset's records less the prompts too long for the engine.

One renderer serves every place a prompt is encoded or counted (rollout, evaluation, the start-up length check,
``--dry_run``), so the prompt a run trains on and the one its length check measured cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rollverify_jax.data.datasets import drop_long_prompts, get_dataset

if TYPE_CHECKING:
    from rollverify_jax.models.tokenizer import Tokenizer

Record = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class PromptRenderer:
    """A record's prompt: its ``prompt``, or with ``chat`` its own ``messages`` when it has them, in the chat
    template, with ``system`` first (unless the record brings a system message) and ``enable_thinking``
    (``Tokenizer.render_prompt``). The settings are ``TrainConfig``'s ``chat_template``, ``system_prompt`` and
    ``enable_thinking``."""

    tokenizer: Tokenizer
    chat: bool = False
    system: str | None = None
    enable_thinking: bool | None = None

    def render(self, record: Mapping[str, Any]) -> str:
        """The text the policy is prompted with."""
        return self.tokenizer.render_prompt(record["prompt"], chat=self.chat, messages=record.get("messages"),
                                            system=self.system, enable_thinking=self.enable_thinking)

    def encode(self, record: Mapping[str, Any]) -> np.ndarray:
        """int32[P]: the prompt ids of ``render(record)``."""
        return np.asarray(self.tokenizer.encode(self.render(record)), np.int32)

    def lengths(self, records: Sequence[Mapping[str, Any]], chunk: int = 4096) -> np.ndarray:
        """int64[N]: the token count of each record's ``encode``; each distinct prompt is rendered and encoded
        once (DAPO-Math-17k repeats its problems), in batches of ``chunk`` (``tokenizers`` runs them in Rust)."""
        keys = [_prompt_key(record) for record in records]
        unique = list(dict(zip(keys, records, strict=True)).items())
        counts: dict[str, int] = {}
        for start in range(0, len(unique), chunk):
            part = unique[start:start + chunk]
            rendered = [self.render(record) for _, record in part]
            counts.update(zip((k for k, _ in part), map(len, self.tokenizer.encode_batch(rendered)), strict=True))
        return np.asarray([counts[k] for k in keys], dtype=np.int64)


def _prompt_key(record: Mapping[str, Any]) -> str:
    """What a prompt's rendering depends on: its text, and its chat messages when it has them."""
    messages = record.get("messages")
    return record["prompt"] if messages is None else json.dumps([record["prompt"], messages], sort_keys=True)


def lost_turns(records: Sequence[Mapping[str, Any]], renderer: PromptRenderer) -> str | None:
    """A warning when the renderer drops part of chat records: without the chat template only a record's last user
    message is its prompt, so a system message or earlier turns (a verl parquet's ``prompt`` list) never reach the
    policy. None when nothing is lost."""
    if renderer.chat:
        return None
    lost = sum(1 for r in records if any(m.get("role") != "user" for m in r.get("messages") or ())
               or sum(m.get("role") == "user" for m in r.get("messages") or ()) > 1)
    if not lost:
        return None
    return (f"{lost} of {len(records)} records are chat conversations (a system message or earlier turns) and "
            "TrainConfig.chat_template = False renders only their last user message: the rest never reaches the "
            "policy. Set TrainConfig.chat_template = True to render them whole (verl always applies the chat "
            "template).")


def load_prompts(role: str, name: str, kwargs: dict, renderer: PromptRenderer, max_len: int) -> list[Record]:
    """The records of dataset ``name`` (built with ``kwargs``) without the prompts longer than ``max_len`` tokens
    (as ``renderer`` counts them), dropped once here with a warning: admitted mid-run, such a prompt would stop the
    run (the scheduler refuses it). ``role`` names the dataset in the messages ("train", "eval", ...)."""
    records = list(get_dataset(name, **kwargs))
    if not records:
        raise ValueError(f"{role[0].upper() + role[1:]} dataset {name!r} with {kwargs} is empty.")
    lost = lost_turns(records, renderer)
    if lost:
        print(f"warning: {role} dataset {name!r}: {lost}", flush=True)
    lengths = renderer.lengths(records)
    kept, dropped = drop_long_prompts(records, lengths, max_len)
    where = (f"longer than {max_len} tokens (the room EngineConfig.max_seq_len - RolloutConfig.max_new_tokens "
             f"leaves; the longest has {int(lengths.max())})")
    if not kept:
        raise ValueError(f"Every prompt of the {role} dataset {name!r} with {kwargs} is {where}; raise "
                         "EngineConfig.max_seq_len or lower RolloutConfig.max_new_tokens.")
    if dropped:
        print(f"warning: {role} dataset {name!r}: dropped {dropped} of {len(records)} prompts {where}; "
              f"{len(kept)} remain.", flush=True)
    return kept
