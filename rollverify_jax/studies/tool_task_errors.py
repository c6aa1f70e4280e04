"""Where a policy goes wrong on the tool task: the first wrong step of each wrong response, by kind.

Reads generations of the ``synthetic_tools`` task (``python -m rollverify_jax.evaluate ... --samples_out F``,
or a run's ``samples/*.jsonl``) and replays each response's steps against its prompt: an inline step
``a+b=c.`` or a call ``<calculator>a*b</calculator><tool_response>c</tool_response>`` must continue from the
previous value (``copy``), use the prompt's next operator (``op``) and operand (``operand``), and an inline step
must compute it (``arithmetic``). It tells reading errors (a wrong sign: the policy did not read the prompt) from
arithmetic errors (sampling noise that RL sharpens away), which decide how fast RL can raise accuracy.

Usage: python -m rollverify_jax.studies.tool_task_errors samples.jsonl [more.jsonl ...]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

from rollverify_jax.data.synthetic_tools import (
    CALL_END,
    CALL_START,
    REPLY_PREFIX,
    REPLY_SUFFIX,
    TOOL_OPS,
    apply_op,
    parse_ops,
)

STEP = re.compile(r"(\d+)(\+|-)(\d+)=(-?\d+)\.|" + re.escape(CALL_START) + r"(\d+)(\*|//)(\d+)" + re.escape(CALL_END)
                  + re.escape(REPLY_PREFIX) + r"([^<]*)" + re.escape(REPLY_SUFFIX))


def first_error(prompt: str, response: str) -> str:
    """The kind of the first step of ``response`` that does not follow ``prompt`` ('none' if every step does)."""
    value = int(re.match(r"Start (\d+)\.", prompt).group(1))
    ops, steps = parse_ops(prompt), STEP.findall(response)
    for (op, operand), (a, o, b, c, ca, co, cb, reply) in zip(ops, steps, strict=False):
        kind = "tool" if op in TOOL_OPS else "inline"
        left, written_op, right = (int(a), o, int(b)) if a else (int(ca), co, int(cb))
        if left != value:
            return "copy of the previous value"
        if written_op != op:
            return f"{kind} step: wrong operator"
        if right != operand:
            return f"{kind} step: wrong operand"
        result = c if a else reply
        if not result.lstrip("-").isdigit():
            return "tool error reply"
        if a and int(result) != apply_op(value, op, operand):
            return f"inline arithmetic ({'value < 100' if value < 100 else 'value >= 100'})"
        value = int(result)
    if len(steps) != len(ops):
        return "too few steps" if len(steps) < len(ops) else "extra steps"
    return "none (final answer)"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("samples", nargs="+", type=Path, help="JSONL rows with prompt, response, reward")
    args = ap.parse_args(argv)
    rows = [json.loads(line) for path in args.samples for line in path.read_text().splitlines() if line.strip()]
    counts = collections.Counter("correct" if r["reward"] > 0 else first_error(r["prompt"], r["response"])
                                 for r in rows)
    print(f"{len(rows)} responses; first error of each wrong one:")
    for kind, n in counts.most_common():
        print(f"  {kind:36s} {n:5d}  {n / len(rows):.3f}")


if __name__ == "__main__":
    main()
