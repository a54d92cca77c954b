#!/usr/bin/env bash
# Create (or reuse) one of the project's two Python environments and give this clone its own interpreter layered on
# it, with ort_optim installed editable from this clone, so `import ort_optim` works from anywhere with it.
#   tools/make_env.sh ort-stack   -> .venv         (torch 2.4.1 + onnxruntime-training-cpu 1.19.2, ORT extensions built)
#   tools/make_env.sh latest      -> .venv-latest  (torch 2.13.0, no ORTModule)
# Environments live outside the clone, under $ORT_OPTIM_CACHE (default ~/.cache/ort-optim), in a folder named by the
# hash of the lock files and this script, so a warm run reuses them and a changed lock builds a fresh one.
# A folder is only marked complete (.complete) after every stage succeeded; an interrupted build is redone.
# The shared environment never holds ort_optim: several clones may use it at once. Each clone's .venv/.venv-latest is
# a small virtual environment of its own (no pip, a second to make) whose site-packages adds the shared environment's
# (a .pth file) and holds the editable install of that clone, so each clone's interpreter imports that clone.
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
mkdir -p "$cache/envs"
cache=$(cd "$cache" && pwd)  # absolute: the clone's environment names the shared one by this path
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

# One setup at a time builds an environment: a second setup of the same one (another clone, another terminal) waits
# for the lock on $env.lock, then finds it complete; without the lock it would `rm -rf` the first one's environment
# midway. The kernel releases the lock when its holder exits, killed or not. Held until the environment is complete,
# not while this clone's own layer is made (each clone makes its own).
exec 9>>"$env.lock"
if ! flock -n 9; then
  echo "[make_env] $name: waiting for another setup building $env" >&2
  flock 9
fi
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
exec 9>&-  # (releases the lock)
# Every run: this clone's own environment, made afresh on top of the shared one. (A link from an older setup is
# removed, never followed: `venv --clear` through it would empty the shared environment.)
layer=$root/$link
layered() {
  if [ -L "$layer" ]; then rm "$layer"; fi
  "$env/bin/python" -m venv --clear --without-pip "$layer" || return
  local shared_site site
  shared_site=$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return
  site=$("$layer/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return
  case $shared_site in *"'"* | *\\*) echo "cannot name $shared_site in a .pth file (a quote or backslash)"; return 1 ;; esac
  # site.addsitedir, not a plain path: it also runs the shared environment's own .pth files
  echo "import site; site.addsitedir('$shared_site')" >"$site/_ort_optim_shared_env.pth"
  echo "$env" >"$layer/shared-environment"
}
stage "make $link, layered on $env" layered
stage "install ort_optim from $root (editable)" \
  "$layer/bin/python" -m pip install --no-deps --no-build-isolation --disable-pip-version-check -e "$root"
