"""Compiles each real config for its TPU slice (deviceless, `rollverify_jax.aot`) and writes docs/scale.md.

Each config runs in its own process (gin state and libtpu stay clean) and leaves its JSON report under
``--reports``; ``--skip_compile`` re-reads the reports to rewrite the table.

    python -m rollverify_jax.studies.aot_table [--configs configs/qwen3_8b_dapo.gin ...] [--out docs/scale.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ["configs/qwen3_4b_dapo.gin", "configs/qwen3_8b_dapo.gin", "configs/qwen3_8b_64k_dapo.gin",
           "configs/qwen3_30b_a3b_dapo.gin"]
GiB = 2**30


def head_commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()


def compile_config(config: str, report: Path) -> dict | None:
    commit = head_commit()
    cmd = [sys.executable, "-m", "rollverify_jax.aot", f"--gin_file={config}", f"--json={report}"]
    print("$ " + " ".join(cmd[1:]), flush=True)
    # No compilation cache: the table's compile times are compiles, not cache loads.
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "ROLLVERIFY_COMPILATION_CACHE": "0"})
    print("\n".join(x for x in done.stdout.splitlines() if x.strip()), flush=True)
    if not report.exists():
        print(done.stderr[-3000:], file=sys.stderr)
        return None
    r = {**json.loads(report.read_text()), "commit": commit}  # the code compiled, not HEAD when the table is written
    report.write_text(json.dumps(r, indent=2) + "\n")
    return r


def table(rows: list[tuple[str, dict]]) -> str:
    head = ("| config | params | context | topology | mesh | resident GiB/chip (state + KV + serving copy) | "
            "peak GiB/chip (program) | HBM GiB | fits | compile s (train / prefill / decode) | est. train step s |")
    out = [head, "|" + " --- |" * head.count(" | ") + " --- |"]
    for config, r in rows:
        res = r["resident"]
        p = r["programs"]
        mesh = "x".join(str(v) for v in r["mesh"].values())
        out.append(
            f"| `{config}` | {r['params'] / 1e9:.1f}B | {r['context']:,} | {r['topology']} | {mesh} | "
            f"{r['resident_bytes_per_device'] / GiB:.1f} ({res['train_state'] / GiB:.1f} + "
            f"{res['kv_pool'] / GiB:.1f} + {res.get('serving_params', 0) / GiB:.1f}) | "
            f"{r['peak_bytes_per_device'] / GiB:.1f} ({r['peak_program']}) | "
            f"{r['hbm_bytes_per_device'] / GiB:.0f} | {'yes' if r['fits'] else '**no**'} | "
            f"{p['train_step']['compile_s']:.0f} / {p['prefill']['compile_s']:.0f} / {p['decode']['compile_s']:.0f}"
            f" | {r['estimate']['train_step_s']:.0f} |")
    return "\n".join(out)


def speed(rows: list[tuple[str, dict]]) -> str:
    """What the compiled programs make of the machine at the length model (estimates, not measurements)."""
    head = ("| config | train: useful positions | micro-batches per update | FLOPs vs one row per sequence | "
            "est. train step s (MFU) | decode tok/s/chip, every slot running: estimate / roofline | "
            "decode_roofline_fraction (on-policy phase) |")
    out = [head, "|" + " --- |" * head.count(" | ") + " --- |"]
    for config, r in rows:
        t, e, d = r["train"], r["estimate"], r.get("decode", {})
        full = d.get("full_slots", {})
        decode = (f"{full['estimate_tokens_per_s_per_chip']:,.0f} / {full['roofline_tokens_per_s_per_chip']:,.0f}"
                  if full else "-")
        fraction = f"{r['decode_roofline_fraction']:.2f}" if "decode_roofline_fraction" in r else "-"
        out.append(f"| `{config}` | {t['train_useful_token_fraction']:.1%} | {t['train_micro_batches_per_update']:.2f}"
                   f" | {t['train_speedup_vs_unpacked']:.2f}x fewer | {e['train_step_s']:.0f} ({e['train_mfu']:.0%}) | "
                   f"{decode} | {fraction} |")
    return "\n".join(out)


def programs(rows: list[tuple[str, dict]]) -> str:
    out = ["| config | program | temporaries GiB | arguments GiB | outputs GiB | aliased GiB | XLA GFLOP (loop "
           "bodies once) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for config, r in rows:
        for name, p in r["programs"].items():
            out.append(f"| `{config}` | {name} | {p['temp_bytes'] / GiB:.2f} | {p['argument_bytes'] / GiB:.2f} | "
                       f"{p['output_bytes'] / GiB:.2f} | {p['alias_bytes'] / GiB:.2f} | {p['flops'] / 1e9:,.0f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="*", default=CONFIGS)
    ap.add_argument("--reports", default="runs/aot")
    ap.add_argument("--out", default="docs/scale.md")
    ap.add_argument("--skip_compile", action="store_true")
    args = ap.parse_args()
    reports = ROOT / args.reports
    reports.mkdir(parents=True, exist_ok=True)
    rows = []
    for config in args.configs:
        path = reports / (Path(config).stem + ".json")
        r = json.loads(path.read_text()) if args.skip_compile and path.exists() else compile_config(config, path)
        if r is not None:
            rows.append((config, r))
    commit = ", ".join(sorted({r.get("commit", "unknown") for _, r in rows}))
    text = (ROOT / args.out).read_text() if (ROOT / args.out).exists() else ""
    marker = "<!-- aot table -->"
    generated = (f"{marker}\nMeasured at commit `{commit}` with `python -m rollverify_jax.studies.aot_table` "
                 f"(libtpu 0.0.42.1, JAX 0.10.2, deviceless).\n\n{table(rows)}\n\n"
                 f"At the length model (estimates from the compiled "
                 f"programs, not measurements; the sections above say what each assumes):\n\n{speed(rows)}\n\n"
                 f"Per program, per chip:\n\n{programs(rows)}\n{marker}")
    if marker in text:
        before, _, rest = text.partition(marker)
        _, _, after = rest.partition(marker)
        text = before + generated + after
    else:
        text = text + "\n" + generated + "\n"
    (ROOT / args.out).write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
