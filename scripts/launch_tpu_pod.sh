#!/usr/bin/env bash
# Runs one training command on every worker of a Cloud TPU VM slice at once (docs/multihost.md).
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/launch_tpu_pod.sh [options] -- TRAIN_ARGS...

Runs `PYTHON -m MODULE --distributed TRAIN_ARGS...` in REPO_DIR on every worker of a TPU VM slice, through
`gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --worker=all --command=...`: one JAX process per host, every
host the same command. JAX finds the other workers through the TPU metadata, so no coordinator flags are needed.
Each worker needs the checkout at REPO_DIR with its venv (pip install -e '.[tpu]'), the policy and the data at
the config's paths; the workdir must be shared by all workers (gs://bucket/... or a common mount).

Options (each also an environment variable; the option wins):
  --name NAME          TPU_NAME   the TPU VM slice (required)
  --zone ZONE          ZONE       its zone (required)
  --project PROJECT    PROJECT    the Google Cloud project (default: gcloud's configured one)
  --repo_dir DIR       REPO_DIR   the checkout on every worker (default: ~/rollverify_jax)
  --python PATH        PYTHON     the interpreter, relative to REPO_DIR or absolute (default: .venv/bin/python)
  --module MODULE      MODULE     the entry point (default: rollverify_jax.train)
  --setup CMD          SETUP      a command run in REPO_DIR on every worker first (e.g. 'git pull --ff-only')
  --detach                        run under nohup with output to LOG on each worker (survives this terminal);
                                  without it, every worker's output streams here until the run ends
  --log FILE           LOG        the log file of --detach (default: ~/rollverify_train.log)
  --print                         print the gcloud command instead of running it
  -h, --help                      this text

Example (Qwen3-8B on a v5p-32, i.e. 16 chips on 4 hosts, the slice configs/qwen3_8b_dapo.gin is sized for):
  TPU_NAME=rv-v5p-32 ZONE=us-east5-a scripts/launch_tpu_pod.sh --detach -- \
      --gin_file=configs/qwen3_8b_dapo.gin --workdir=gs://my-bucket/runs/qwen3_8b_dapo
EOF
}

# Defaults with a literal ~ : it must expand on the workers, not here.
default_repo_dir='~/rollverify_jax'
default_log='~/rollverify_train.log'
name=${TPU_NAME:-}
zone=${ZONE:-}
project=${PROJECT:-}
repo_dir=${REPO_DIR:-$default_repo_dir}
python=${PYTHON:-.venv/bin/python}
module=${MODULE:-rollverify_jax.train}
setup=${SETUP:-}
log=${LOG:-$default_log}
detach=0
print_only=0

if [[ $# -eq 0 ]]; then
  usage >&2
  exit 2
fi
value() {  # the value of option $1, or an error when it has none
  if [[ $# -lt 2 || $2 == --* ]]; then
    echo "error: $1 needs a value; --help for usage" >&2
    exit 2
  fi
  printf '%s' "$2"
}
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --name) name=$(value "$@"); shift 2 ;;
    --zone) zone=$(value "$@"); shift 2 ;;
    --project) project=$(value "$@"); shift 2 ;;
    --repo_dir) repo_dir=$(value "$@"); shift 2 ;;
    --python) python=$(value "$@"); shift 2 ;;
    --module) module=$(value "$@"); shift 2 ;;
    --setup) setup=$(value "$@"); shift 2 ;;
    --log) log=$(value "$@"); shift 2 ;;
    --detach) detach=1; shift ;;
    --print) print_only=1; shift ;;
    --) shift; break ;;
    *) echo "error: unknown option $1 (the training arguments go after --)" >&2; exit 2 ;;
  esac
done
if [[ -z $name || -z $zone ]]; then
  echo "error: the TPU name and zone are required (--name/TPU_NAME, --zone/ZONE); --help for usage" >&2
  exit 2
fi
if [[ $# -eq 0 ]]; then
  echo "error: no training arguments after -- (e.g. --gin_file=configs/qwen3_8b_dapo.gin); --help for usage" >&2
  exit 2
fi

# A path for the remote shell: a leading ~/ stays unquoted so that it expands there, the rest is quoted.
remote_path() {
  if [[ $1 == "~/"* ]]; then
    printf '~/%q' "${1#\~/}"
  else
    printf '%q' "$1"
  fi
}

train=("$@")
if [[ " ${train[*]} " != *" --distributed "* ]]; then
  train=(--distributed "${train[@]}")
fi
run="$(remote_path "$python") -m $(printf '%q' "$module")$(printf ' %q' "${train[@]}")"
if [[ $detach -eq 1 ]]; then
  run="nohup $run > $(remote_path "$log") 2>&1 < /dev/null &"
fi
command="cd $(remote_path "$repo_dir") && "
if [[ -n $setup ]]; then
  command+="{ $setup; } && "
fi
command+="$run"

gcloud_cmd=(gcloud compute tpus tpu-vm ssh "$name" "--zone=$zone" --worker=all "--command=$command")
if [[ -n $project ]]; then
  gcloud_cmd+=("--project=$project")
fi
if [[ $print_only -eq 1 ]]; then
  printf '%q ' "${gcloud_cmd[@]}"
  echo
  exit 0
fi
echo "launching on every worker of $name ($zone): $run" >&2
"${gcloud_cmd[@]}"
if [[ $detach -eq 1 ]]; then
  echo "started; follow one worker with: gcloud compute tpus tpu-vm ssh $name --zone=$zone --worker=0 \
--command='tail -f $log'" >&2
fi
