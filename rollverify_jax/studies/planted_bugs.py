"""Plants one-line bugs in the method's core and checks that the test suite catches each one.

Each bug is a single-line edit of the source. It is applied to a scratch copy of the repository (the working
tree is never touched), the tests that cover that code run against the copy, and the bug counts as caught when
they fail. The table goes to stdout and to ``docs/planted_bugs.md``.

    python -m rollverify_jax.studies.planted_bugs [--only NAME ...] [--out docs/planted_bugs.md]
    python -m rollverify_jax.studies.planted_bugs --only NAME ... --merge   # re-measure some rows, keep the others
    python -m rollverify_jax.studies.planted_bugs --dry_run   # every bug still plants; the table, nothing run
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Bug:
    name: str
    path: str
    old: str  # must occur exactly once; it may span lines for context, but only one line changes
    new: str
    tests: tuple[str, ...]


T = "tests/test_train.py::"
P = "tests/test_partial_rollout.py::"
BUGS = [
    Bug("verifier: token stage `>=` -> `>`", "rollverify_jax/verify/verifier.py",
        "& (ops >= dt)", "& (ops > dt)", ("tests/test_verifier.py",)),
    Bug("verifier: a NaN token is no longer cut", "rollverify_jax/verify/verifier.py",
        "jnp.where(jnp.isnan(ops), jnp.inf, ops)", "ops", ("tests/test_verifier.py",)),
    Bug("TIS weight without stop-gradient", "rollverify_jax/rl/losses.py",
        "return jax.lax.stop_gradient(jnp.exp(jnp.minimum(0.0, math.log(cfg.tis_cap) - lr)))",
        "return jnp.exp(jnp.minimum(0.0, math.log(cfg.tis_cap) - lr))", ("tests/test_losses.py",)),
    Bug("seq-mean counts fully masked rows", "rollverify_jax/rl/losses.py",
        "live = (token_count > 0).astype(jnp.float32)", "live = jnp.ones_like(token_count)",
        ("tests/test_losses.py",)),
    Bug("checkpoint restore ignores the commit marker", "rollverify_jax/run/checkpoint.py",
        "if (self.directory / str(s) / COMMIT_FILE).exists())", ")", ("tests/test_checkpoint.py",)),
    Bug("`Trajectory.truncate` leaves a cut trajectory finished", "rollverify_jax/rollout/trajectory.py",
        "            self.finished = False\n", "            pass\n", ("tests/test_scheduler.py",)),
    Bug("scheduler ignores a verifier cut of a finished group member", "rollverify_jax/rollout/scheduler.py",
        "if t.finished and k >= t.num_tokens:", "if t.finished:", ("tests/test_scheduler.py",)),
    Bug("the verifier receives version 0 for every token", "rollverify_jax/rollout/scheduler.py",
        "versions[i, :n] = view.versions", "versions[i, :n] = 0",
        ("tests/test_scheduler.py", "tests/test_partial_rollout.py")),
    Bug("staleness from the newest token (cache, filter and metrics)", "rollverify_jax/verify/ops.py",
        "current_version - min(v) if len(v)", "current_version - max(v) if len(v)",
        ("tests/test_buffer.py", "tests/test_filters.py",
         T + "test_staleness_filter_drops_exactly_the_stale_trajectories")),
    Bug("staleness filter drops at s_max", "rollverify_jax/rl/filters.py",
        "return trajectory_staleness(current_version, versions) <= s_max",
        "return trajectory_staleness(current_version, versions) < s_max", ("tests/test_filters.py",)),
    Bug("OPS filter inverted", "rollverify_jax/rl/filters.py",
        "return np.asarray(seq_ops) <= threshold", "return np.asarray(seq_ops) > threshold",
        ("tests/test_filters.py", T + "test_ops_filter_keeps_fresh_trajectories_and_drops_shifted_ones")),
    Bug("OPS filter masks tokens by log mu != 0", "rollverify_jax/rl/filters.py",
        "x.behavior_logp), x.response_mask)", "x.behavior_logp), x.behavior_logp != 0)", ("tests/test_filters.py",)),
    Bug("finished members of unfinished groups never re-verified", "rollverify_jax/rl/partial_rollout.py",
        "include_finished=self.verifying and self.verify_cfg.verify_finished", "include_finished=False",
        ("tests/test_partial_rollout.py",)),
    Bug("complete groups carried beyond B train unverified", "rollverify_jax/rl/buffer.py",
        "            for gid in sorted(self.groups):\n",
        "            for gid in sorted(g for g in self.groups if not self.groups[g].complete):\n",
        ("tests/test_buffer.py", "tests/test_partial_rollout.py")),
    Bug("regeneration after a cut replays the removed tokens' keys", "rollverify_jax/rollout/scheduler.py",
        "[t.sample_seed for t in gt]", "[t.seed for t in gt]", ("tests/test_scheduler.py",)),
    Bug("resume discards the restored train state", "rollverify_jax/run/builder.py",
        "_, trainer.train_state, extra = restored", "_, _, extra = restored",
        (T + "test_resumed_run_equals_uninterrupted_run",)),
    Bug("the switch to on-policy never happens", "rollverify_jax/rl/partial_rollout.py",
        "if self.switch_state.on_policy:", "if False:", (T + "test_low_acceptance_switches_to_on_policy_for_good",)),
    Bug("every group treated as uniform-reward", "rollverify_jax/rl/step.py",
        "uniform = np.repeat((rewards == rewards[:, :1]).all(axis=1), rewards.shape[1])",
        "uniform = np.repeat(np.ones(len(rewards), bool), rewards.shape[1])",
        (T + "test_uniform_groups_leave_the_loss",)),
    Bug("DAPO chat prompts take the first user message", "rollverify_jax/data/sources.py",
        'return messages[users[-1]]["content"], messages', 'return messages[users[0]]["content"], messages',
        ("tests/test_datasets.py",)),
    Bug("a hung grader is never killed (no deadline for its worker)", "rollverify_jax/data/rewards.py",
        "timeout=self.timeout_s + self.hard_timeout_grace_s)", "timeout=None)", ("tests/test_rewards.py",)),
    # Issue 50: the code added since the first 20 (packed and shared prefill, tool use, the run spec, the workdir
    # lock, restore errors, evaluation, reward plug-ins, the packed learner, the asynchronous mode, scoring).
    Bug("a group's shared prompt K/V is copied into the pages of its admission index, not its slot",
        "rollverify_jax/rollout/engine.py", "table[slots[source[i]], p], table[slots[i], p])",
        "table[slots[source[i]], p], table[i, p])", ("tests/test_engine.py",)),
    Bug("packed prefill: sequences sharing a row attend to each other (one segment)",
        "rollverify_jax/rollout/engine.py",
        "tokens[r, cols], positions[r, cols], segments[r, cols] = seq[:-1], pos, segment",
        "tokens[r, cols], positions[r, cols], segments[r, cols] = seq[:-1], pos, 1", ("tests/test_engine.py",)),
    Bug("verify_finished: re-verified finished members counted in the acceptance rate",
        "rollverify_jax/rl/partial_rollout.py",
        "verified = _verify_summary(sched.verified)",
        "verified = _verify_summary(sched.verified + sched.verified_finished)",
        (P + "test_with_verify_finished_the_acceptance_still_counts_paused_trajectories_only",)),
    Bug("async: the staleness cap admits one batch more", "rollverify_jax/rl/partial_rollout.py",
        "cap = (self.async_cfg.max_staleness + 1) * self.config.batch_groups",
        "cap = (self.async_cfg.max_staleness + 2) * self.config.batch_groups",
        (P + "test_async_cycles_hold_the_staleness_cap_and_treat_the_running_trajectories_as_at_swap_says",)),
    Bug("async: 'reprefill' verifies at the swap like 'verify'", "rollverify_jax/rl/partial_rollout.py",
        'self.asynchronous and self.async_cfg.at_swap == "verify")',
        'self.asynchronous and self.async_cfg.at_swap != "keep_stale_kv")',
        (P + "test_async_cycles_hold_the_staleness_cap_and_treat_the_running_trajectories_as_at_swap_says",)),
    Bug("async: a staged copy of another dtype is installed", "rollverify_jax/rollout/publish.py",
        "if s is None or s.shape != w.shape or s.dtype != w.dtype or s.sharding != w.sharding:",
        "if s is None or s.shape != w.shape or s.sharding != w.sharding:",
        ("tests/test_async_rollout.py::test_a_failed_or_partial_publish_leaves_the_previous_version",)),
    Bug("async: the learner's weights are published as the previous version", "rollverify_jax/run/trainer.py",
        "self.publisher.stage(self.train_state.params, self.step)",
        "self.publisher.stage(self.train_state.params, self.step - 1)",
        ("tests/test_async_rollout.py::test_an_async_run_publishes_verifies_and_resumes_exactly",)),
    Bug("resume fingerprint: the reward is bookkeeping (a resume with another reward goes on)",
        "rollverify_jax/run/spec.py", 'NOT_COMPARED_PARTS = frozenset({"checkpoint",',
        'NOT_COMPARED_PARTS = frozenset({"reward", "checkpoint",', ("tests/test_spec.py",)),
    Bug("resume fingerprint: execution settings left out (a changed kernel is not reported)",
        "rollverify_jax/run/spec.py", "if name not in NOT_COMPARED:",
        "if name not in NOT_COMPARED and name not in EXECUTION_SETTINGS:", ("tests/test_spec.py",)),
    Bug("scoring: each response graded by another record's data-source reward", "rollverify_jax/data/rewards.py",
        "record = records[i] if records is not None else None",
        "record = records[-1 - i] if records is not None else None", ("tests/test_spec.py",)),
    Bug("reward plug-ins: a verl reward gets no extra_info", "rollverify_jax/data/plugins.py",
        '"ground_truth": answer, "extra_info": context.get("extra_info")}',
        '"ground_truth": answer, "extra_info": None}',
        ("tests/test_rewards.py::test_verl_and_trl_rewards_per_data_source",)),
    Bug("tool use: one tool call past max_calls gets a reply", "rollverify_jax/rollout/tool_use.py",
        "return t.tool_calls < self.config.max_calls and", "return t.tool_calls <= self.config.max_calls and",
        ("tests/test_tool_use.py::test_a_call_past_the_budget_ends_the_trajectory",)),
    Bug("packed learner: RoPE positions run on across a packed row", "rollverify_jax/rl/packing.py",
        "out[keys[1]][flat_row, cols] = np.arange(m)", "out[keys[1]][flat_row, cols] = np.arange(offset, offset + m)",
        ("tests/test_packing.py",)),
    Bug("workdir lock: a lock whose pid was reused is never taken over", "rollverify_jax/run/workdir_lock.py",
        'if started[0] > float(holder.get("started", 0)) + 1.0:',
        'if started[0] > float(holder.get("started", 0)) + 1e9:',
        ("tests/test_workdir_lock.py",)),
    Bug("restore: any tensorstore error is taken for damage (the step is moved aside)",
        "rollverify_jax/run/checkpoint.py",
        "if code in _DAMAGE_CODES:", "if code is not None:", ("tests/test_checkpoint.py",)),
    Bug("evaluation: maj@k votes over all n samples", "rollverify_jax/run/evaluation.py",
        "for j, answer in enumerate(row[:k]):", "for j, answer in enumerate(row):",
        ("tests/test_evaluate.py::test_pass_at_k_is_the_unbiased_estimator_and_maj_at_k_votes_on_extracted_answers",)),
    Bug("LoRA: B starts random (an adapted model no longer starts at its base)", "rollverify_jax/models/lora.py",
        "            value = jnp.zeros(shape, dtype)",
        "            value = init_a(jax.random.fold_in(key, i), shape, jnp.float32).astype(dtype)",
        ("tests/test_lora.py::test_adapters_cover_every_linear_layer_and_start_at_the_base",)),
    Bug("LoRA: adapter A sharded along the weight's output axis", "rollverify_jax/models/lora.py",
        "logical_axes=(axes[0], None)", "logical_axes=(axes[1], None)",
        ("tests/test_lora.py::test_adapters_are_sharded_like_the_weights_they_adapt",)),
    Bug("LoRA: the merge scales by rank / alpha", "rollverify_jax/models/lora.py",
        "(w.astype(jnp.float32) + cfg.scale * (a @ b))", "(w.astype(jnp.float32) + (a @ b) / cfg.scale)",
        ("tests/test_lora.py::test_adapted_forward_is_base_plus_scaled_low_rank_update",)),
    Bug("LoRA: the checkpoint forgets the base's hash", "rollverify_jax/run/builder.py",
        "lora_base_sha256=weights_sha256(policy_path) if policy_path is not None else None)",
        "lora_base_sha256=None)",
        ("tests/test_lora.py::test_a_lora_run_resumes_exactly_exports_merged_and_peft_and_refuses_another_base",)),
]


def _copy_repo(dest: Path) -> None:
    ignore = shutil.ignore_patterns(".venv", ".git", "runs", "__pycache__", ".pytest_cache", ".hypothesis",
                                    "mutants", "*.egg-info")
    shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)


def plant(bug: Bug, tree: Path) -> None:
    path = tree / bug.path
    path.write_text(planted(bug, path.read_text()))


def planted(bug: Bug, source: str) -> str:
    """``source`` with the bug in it; an error when its line is not there exactly once or it changes more."""
    if source.count(bug.old) != 1:
        raise SystemExit(f"{bug.name}: the text to replace occurs {source.count(bug.old)} times in {bug.path}; "
                         "it must occur exactly once (has the code changed?).")
    changed = [a for a, b in zip(bug.old.splitlines(), bug.new.splitlines(), strict=False) if a != b]
    if len(changed) != 1 or len(bug.old.splitlines()) != len(bug.new.splitlines()):
        raise SystemExit(f"{bug.name}: a planted bug changes exactly one line.")
    return source.replace(bug.old, bug.new)


def check_tests(bug: Bug) -> None:
    """Every test the bug names exists (its file, and the test function where one is named)."""
    for test in bug.tests:
        file, _, name = test.partition("::")
        if not (ROOT / file).is_file() or (name and f"def {name}(" not in (ROOT / file).read_text()):
            raise SystemExit(f"{bug.name}: the test {test} does not exist (was it moved or renamed?).")


def run_tests(tree: Path, tests: tuple[str, ...]) -> tuple[bool, float, str]:
    """(tests failed, seconds, last line of pytest's summary)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                          cwd=tree, env=env, capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.strip()]
    return proc.returncode != 0, time.perf_counter() - t0, lines[-1] if lines else proc.stderr[-200:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=None, help="substrings of bug names to run")
    ap.add_argument("--out", default=str(ROOT / "docs" / "planted_bugs.md"))
    ap.add_argument("--dry_run", action="store_true", help="plant each bug in memory and check its tests exist; "
                    "print the table without running them (nothing written)")
    ap.add_argument("--merge", action="store_true", help="with --only: write the table with the bugs run now "
                    "re-measured (each row names its commit) and every other row as --out already has it")
    args = ap.parse_args()
    bugs = [b for b in BUGS if not args.only or any(s in b.name for s in args.only)]
    rows = []
    if args.dry_run:
        for bug in bugs:
            planted(bug, (ROOT / bug.path).read_text())
            check_tests(bug)
        print(report([(bug, None, 0.0, "") for bug in bugs], "dry run"))
        return
    # The commit the run starts at (the tree it copies for each bug is the working tree: leave it alone meanwhile).
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    for bug in bugs:
        check_tests(bug)  # a test that is not there fails pytest too: it must not count as a catch
        with tempfile.TemporaryDirectory(prefix="planted_") as tmp:
            tree = Path(tmp) / "repo"
            _copy_repo(tree)
            plant(bug, tree)
            caught, seconds, summary = run_tests(tree, bug.tests)
        rows.append((bug, caught, seconds, summary))
        print(f"{'CAUGHT' if caught else 'MISSED'}  {bug.name}  ({seconds:.0f} s: {summary})", flush=True)
    if args.merge:
        text = merged(Path(args.out).read_text(), rows, commit)
    else:
        text = report(rows, commit)
    if not args.only or args.merge:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    print(f"caught {sum(bool(c) for _, c, _, _ in rows)} of {len(rows)}")


def _row(bug: Bug, caught: bool | None, seconds: float, summary: str, at: str = "") -> str:
    tests = ", ".join(f"`{t.replace('tests/', '')}`" for t in bug.tests)
    said = "-" if caught is None else f"{summary.replace('|', '/')} ({seconds:.0f} s{at})"
    shown = "not run" if caught is None else "yes" if caught else "**no**"
    return f"| {bug.name} | `{bug.path}` | {tests} | {shown} | {said} |"


def merged(old: str, rows: list[tuple[Bug, bool | None, float, str]], commit: str) -> str:
    """The table ``old`` (docs/planted_bugs.md) with ``rows`` re-measured at ``commit`` (said in each row) and
    every other bug's row kept as it was (not run: a bug it does not have yet), in ``BUGS`` order."""
    kept = {line.split(" | ")[0][2:]: line for line in old.splitlines()
            if line.startswith("| ") and not line.startswith(("| planted bug ", "| --- "))}
    now = {bug.name: _row(bug, caught, seconds, summary, f"; measured at `{commit}`")
           for bug, caught, seconds, summary in rows}
    lines = [now.get(b.name) or kept.get(b.name) or _row(b, None, 0.0, "") for b in BUGS]
    header = old.split("| planted bug |")[0].rstrip("\n").splitlines()
    caught = sum(" | yes | " in line for line in lines)
    return "\n".join([*header, "", "| planted bug | file | tests run | caught | pytest says |",
                      "| --- | --- | --- | --- | --- |", *lines, "", f"Caught: {caught} of {len(lines)}.", ""])


def report(rows: list[tuple[Bug, bool | None, float, str]], commit: str) -> str:
    """docs/planted_bugs.md from (bug, caught (None: not run), seconds, pytest's summary line) rows."""
    lines = ["# Planted bugs", "",
             f"Measured by `python -m rollverify_jax.studies.planted_bugs` at commit `{commit}` (plus the working tree "
             "it ran on).",
             "Each bug is a one-line edit planted in a scratch copy of the repository; the tests listed run",
             "against it, and the bug is caught when they fail.", "",
             "| planted bug | file | tests run | caught | pytest says |", "| --- | --- | --- | --- | --- |"]
    lines += [_row(bug, caught, seconds, summary) for bug, caught, seconds, summary in rows]
    lines += ["", f"Caught: {sum(bool(c) for _, c, _, _ in rows)} of {len(rows)}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
