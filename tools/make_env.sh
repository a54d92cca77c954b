#!/usr/bin/env bash
# Create (or reuse) one of the project's two Python environments and link it into the repo.
#   tools/make_env.sh ort-stack   -> .venv         (torch 2.4.1 + onnxruntime-training-cpu 1.19.2, ORT extensions built)
#   tools/make_env.sh latest      -> .venv-latest  (torch 2.13.0, no ORTModule)
# Environments live outside the clone, under $ORT_OPTIM_CACHE (default ~/.cache/ort-optim), in a folder named by the
# hash of the lock files and this script, so a warm run reuses them and a changed lock builds a fresh one.
# A folder is only marked complete (.complete) after every step succeeded; an interrupted build is redone.
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
if [ ! -f "$env/.complete" ]; then
  echo "[make_env] building $name environment in $env" >&2
  rm -rf "$env"
  mkdir -p "$cache/envs"
  "$python" -m venv "$env"
  "$env/bin/python" -m pip install -q --upgrade pip==24.2
  "$env/bin/python" -m pip install -q -r "$lock"
  if [ -s "$nodeps" ]; then
    "$env/bin/python" -m pip install -q --no-deps -r "$nodeps"
  fi
  if [ "$name" = ort-stack ]; then
    # ORT's C++/CUDA interop extensions for ORTModule (about 5 minutes on 2 cores).
    MAX_JOBS=${MAX_JOBS:-2} "$env/bin/python" -m onnxruntime.training.ortmodule.torch_cpp_extensions.install
  fi
  touch "$env/.complete"
else
  echo "[make_env] reusing $name environment $env" >&2
fi
ln -sfn "$env" "$root/$link"
