#!/usr/bin/env bash
# Create (or reuse) one of the project's two Python environments, link it into the repo and install ort_optim
# into it (editable, pointing at this checkout), so `import ort_optim` works from anywhere with that interpreter.
#   tools/make_env.sh ort-stack   -> .venv         (torch 2.4.1 + onnxruntime-training-cpu 1.19.2, ORT extensions built)
#   tools/make_env.sh latest      -> .venv-latest  (torch 2.13.0, no ORTModule)
# Environments live outside the clone, under $ORT_OPTIM_CACHE (default ~/.cache/ort-optim), in a folder named by the
# hash of the lock files and this script, so a warm run reuses them and a changed lock builds a fresh one.
# A folder is only marked complete (.complete) after every stage succeeded; an interrupted build is redone.
# Quiet by design: one line per stage with its duration; the tools' output goes to <env>.log and its tail is
# printed when a stage fails.
set -euo pipefail
name=${1:?usage: tools/make_env.sh ort-stack|latest}
root=$(cd "$(dirname "$0")/.." && pwd)
case "$name" in
  ort-stack) link=.venv ;;
  latest) link=.venv-latest ;;
  *) echo "unknown environment '$name' (expected ort-stack or latest)" >&2; exit 2 ;;
esac
python=${ORT_OPTIM_PYTHON:-python3.11}
lock=$root/requirements/$name.txt
nodeps=$root/requirements/$name-nodeps.txt
hash=$(cat "$lock" "$nodeps" "$root/tools/make_env.sh" | sha256sum | cut -c1-16)
cache=${ORT_OPTIM_CACHE:-$HOME/.cache/ort-optim}
env=$cache/envs/$name-$hash
log=$env.log

# stage "what" command...: runs the command with its output appended to $log; prints "what ... N s" or the log's tail.
stage() {
  local what=$1 started=$SECONDS
  shift
  printf '[make_env] %s: %s ... ' "$name" "$what" >&2
  echo "=== $(date -u +%FT%TZ) $what: $*" >>"$log"
  if "$@" >>"$log" 2>&1; then
    echo "$((SECONDS - started)) s" >&2
  else
    local rc=$?
    echo "FAILED after $((SECONDS - started)) s (exit $rc); the last lines of $log:" >&2
    tail -n 60 "$log" >&2
    exit "$rc"
  fi
}

mkdir -p "$cache/envs"
if [ ! -f "$env/.complete" ]; then
  rm -rf "$env"
  : >"$log"
  echo "[make_env] $name: building $env (log: $log)" >&2
  stage "create the virtual environment" "$python" -m venv "$env"
  stage "pip 24.2" "$env/bin/python" -m pip install --upgrade pip==24.2
  stage "install requirements/$name.txt" "$env/bin/python" -m pip install -r "$lock"
  if [ -s "$nodeps" ]; then
    stage "install requirements/$name-nodeps.txt (--no-deps)" "$env/bin/python" -m pip install --no-deps -r "$nodeps"
  fi
  if [ "$name" = ort-stack ]; then
    # ORT's C++/CUDA interop extensions for ORTModule (about 5 minutes on 2 cores).
    stage "build ORTModule's extensions" env MAX_JOBS="${MAX_JOBS:-2}" \
      "$env/bin/python" -m onnxruntime.training.ortmodule.torch_cpp_extensions.install
  fi
  touch "$env/.complete"
else
  echo "[make_env] $name: reusing $env" >&2
fi
ln -sfn "$env" "$root/$link"
# Every run: the environment may be shared by several clones; the editable install points it at this one.
stage "install ort_optim from $root (editable)" \
  "$env/bin/python" -m pip install --no-deps --no-build-isolation --disable-pip-version-check -e "$root"
