#!/usr/bin/env bash
# Issue 16's studies and issue 25 item 1's (study 6) on the tiny task (docs/results/studies.md): every
# configs/studies/*.gin row, 3 seeds, 25 steps, 3 runs at a time, then one report per study from the shared runs
# (runs/compare_studies/).
# Usage: scripts/studies.sh [--skip_runs]   (about 2 hours on a 2-core machine)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
S=configs/studies
COMMON=(--steps 25 --seeds 0 1 2 --jobs 3)
if [[ "${1:-}" != "--skip_runs" ]]; then
  "$PY" -m rollverify_jax.studies.compare --name studies "${COMMON[@]}" --configs $S/onpolicy.gin $S/partial.gin \
    $S/rollverify.gin $S/staleness_s1.gin $S/staleness_s2.gin $S/opsfilter_d0.01.gin $S/opsfilter_d0.05.gin \
    $S/rollverify_ds0.005.gin $S/rollverify_ds0.02.gin $S/rollverify_dt1.gin $S/rollverify_dt4.gin \
    $S/sequence_stage_only.gin $S/two_stages_no_switch.gin $S/gspo.gin $S/sapo.gin $S/vespo.gin \
    $S/rollverify_verify_finished.gin $S/rollverify_train_extra.gin
fi
report() { name=$1; shift; "$PY" -m rollverify_jax.studies.compare --name "$name" --runs_name studies "${COMMON[@]}" --skip_runs \
  --configs "${@/#/$S/}"; }
report study_drift onpolicy.gin partial.gin rollverify.gin
report study_filters partial.gin staleness_s1.gin staleness_s2.gin opsfilter_d0.01.gin opsfilter_d0.05.gin \
  rollverify.gin
report study_thresholds rollverify_ds0.005.gin rollverify.gin rollverify_ds0.02.gin rollverify_dt1.gin \
  rollverify_dt4.gin
report study_ablation sequence_stage_only.gin two_stages_no_switch.gin rollverify.gin
report study_losses onpolicy.gin partial.gin gspo.gin sapo.gin vespo.gin rollverify.gin
report study_verify rollverify.gin rollverify_verify_finished.gin rollverify_train_extra.gin
# study 6's table and Welch tests against the default (studies.md section 6)
"$PY" -m rollverify_jax.studies.verify_stats --runs_name studies --configs rollverify rollverify_verify_finished \
  rollverify_train_extra
