#!/usr/bin/env bash
# Idempotent, self-contained setup: .venv with the pinned stack, and horovod built with
# TensorFlow + Gloo (only when the installed build lacks either). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# PROFILE=tf215 (default): tensorflow-cpu 2.15.1, Keras 2 built in, horovod.
# PROFILE=tf218: tensorflow-cpu 2.18.1 + tf-keras, used with TF_USE_LEGACY_KERAS=1, horovod.
# PROFILE=modern (or PROFILE=torch: the same environment): Spark 4 (with Spark Connect's client),
#   current tensorflow-cpu with Keras 3 and torch 2.13.0 (CPU) with its ecosystem, numpy 2,
#   MLflow 3, no horovod (backend="tf" and backend="torch").
PROFILE=${PROFILE:-tf215}
HOROVOD=1
EXTRAS=spark,dev
case "$PROFILE" in
  tf215) VENV=.venv; CONSTRAINTS=constraints.txt; FRAMEWORK_PKGS=("tensorflow-cpu==2.15.1")
         EXTRAS=spark,dev,docs ;;
  tf218) VENV=.venv-tf218; CONSTRAINTS=constraints-tf218.txt
         FRAMEWORK_PKGS=("tensorflow-cpu==2.18.1" "tf-keras==2.18.0"); export TF_USE_LEGACY_KERAS=1 ;;
  # torch's ecosystem too (Lightning, transformers, accelerate, DeepSpeed): the tests run them.
  modern|torch) VENV=.venv-modern; CONSTRAINTS=constraints-modern.txt; HOROVOD=0
                EXTRAS=spark,connect,dev,torch,torch-clients
                FRAMEWORK_PKGS=("tensorflow-cpu==2.21.0" "torch==2.13.0") ;;
  *) printf '[setup] ERROR: unknown PROFILE=%s (use tf215, tf218, modern or torch)\n' "$PROFILE" >&2; exit 1 ;;
esac

say() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

"$PYTHON" -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] <= (3, 11) else 1)' \
  || die "Python 3.10-3.11 is required (TensorFlow 2.15, horovod 0.28); found $("$PYTHON" --version 2>&1). Set PYTHON=/path/to/python3.11."
command -v java >/dev/null 2>&1 \
  || die "Java (11 or 17) is required by Spark. Install it, e.g. 'apt-get install -y openjdk-17-jre-headless', or set JAVA_HOME."

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)

stamp="$VENV/.stamp-deps-$(cat "$CONSTRAINTS" pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  say "installing the pinned stack ($CONSTRAINTS) into $VENV"
  # horovod's build needs setuptools < 70; torch (and DeepSpeed's op builds) need >= 77.
  if [ "$HOROVOD" = 1 ]; then SETUPTOOLS="setuptools<70"; else SETUPTOOLS="setuptools>=77,<81"; fi
  "${PIP[@]}" install -q --upgrade "pip<25" wheel "$SETUPTOOLS"
  # The framework first: horovod's build looks for TensorFlow, DeepSpeed's for torch.
  "${PIP[@]}" install -q -c "$CONSTRAINTS" "${FRAMEWORK_PKGS[@]}" "cmake<4"
  "${PIP[@]}" install -q -c "$CONSTRAINTS" --no-build-isolation -e ".[$EXTRAS]"
  rm -f "$VENV"/.stamp-deps-* "$VENV"/.stamp-horovod-*
  touch "$stamp"
fi

horovod_ok() {
  local out
  out=$("$VENV/bin/horovodrun" --check-build 2>/dev/null) || return 1
  grep -q '\[X\] TensorFlow' <<<"$out" && grep -q '\[X\] Gloo' <<<"$out"
}

hstamp="$VENV/.stamp-horovod-${stamp##*-}"
if [ "$HOROVOD" = 1 ] && [ ! -f "$hstamp" ]; then
  if ! horovod_ok; then
    # The wheel is built once per TensorFlow build and Python and kept in our own cache (pip's
    # wheel cache cannot tell a build with TensorFlow + Gloo from one without).
    tf_build=$("$PY" -c 'import tensorflow as tf, sys; print(tf.__version__, sys.version_info[:2])' 2>/dev/null | sha256sum | cut -c1-12)
    wheels="${XDG_CACHE_HOME:-$HOME/.cache}/sparkhvd/horovod-0.28.1-$tf_build"
    if ! ls "$wheels"/horovod-0.28.1-*.whl >/dev/null 2>&1; then
      say "building horovod 0.28.1 from source with TensorFlow + Gloo (about 3 minutes; kept in $wheels)"
      rm -rf "$wheels.tmp"
      HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
        HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS=-j"$(nproc)" \
        "${PIP[@]}" wheel -q -c "$CONSTRAINTS" --no-deps --no-build-isolation --no-cache-dir \
        -w "$wheels.tmp" "horovod==0.28.1"
      mkdir -p "$(dirname "$wheels")" && rm -rf "$wheels" && mv "$wheels.tmp" "$wheels"
    fi
    "${PIP[@]}" uninstall -q -y horovod >/dev/null 2>&1 || true
    "${PIP[@]}" install -q -c "$CONSTRAINTS" --no-build-isolation --find-links "$wheels" \
      "horovod[spark]==0.28.1"
  fi
  horovod_ok || { [ -n "${wheels:-}" ] && rm -rf "$wheels"; false; } || die "horovod is installed but 'horovodrun --check-build' does not show both TensorFlow and Gloo. Check the build log above (cmake<4 and a C++17 compiler are required)."
  touch "$hstamp"
fi
# DeepSpeed compiles its CPU shared-memory communication op the first time a process uses it
# (a C++ build: about three minutes of CPU). Built here, once per environment, into the
# environment's own folder -- the tests point TORCH_EXTENSIONS_DIR there (tests/conftest.py) --
# so no test pays it, and environments at other paths do not rebuild each other's.
if [ "$HOROVOD" = 0 ] && [ ! -f "$VENV/torch-extensions/deepspeed_shm_comm/deepspeed_shm_comm.so" ] \
    && "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("deepspeed") is None)'; then
  say "building DeepSpeed's CPU communication op into $VENV/torch-extensions (once)"
  TORCH_EXTENSIONS_DIR="$PWD/$VENV/torch-extensions" "$PY" -c '
from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder("ShareMemCommBuilder").load()' >/dev/null 2>&1 \
    || say "WARNING: DeepSpeed's CPU op did not build here; the DeepSpeed tests build it themselves"
fi
# Azurite (the Azure Blob emulator) for the storage tests: real adlfs against 127.0.0.1. One
# install at a time (CI sets up two profiles at once; both share .tools/).
mkdir -p .tools
exec 9>.tools/.setup.lock
flock 9 2>/dev/null || true
if [ ! -x .tools/node_modules/.bin/azurite-blob ]; then
  if command -v npm >/dev/null 2>&1; then
    say "installing Azurite into .tools/ (npm)"
    npm install --silent --no-audit --no-fund --prefix .tools azurite@3.35.0 >/dev/null \
      || die "npm could not install azurite; the storage tests need it."
  else
    say "WARNING: Node.js/npm not found: the abfss:// storage tests need Azurite. Install Node.js 18+ (e.g. 'apt-get install -y nodejs npm') and run 'make setup' again."
  fi
fi
exec 9>&-
versions=$("$PY" - 2>/dev/null <<'PYEOF'
import importlib.util, numpy, pyspark, sparkhvd
frameworks = []
if importlib.util.find_spec("tensorflow"):
    import tensorflow as tf
    keras = getattr(tf.keras, "__version__", None) or __import__("keras").__version__
    frameworks.append(f"tensorflow {tf.__version__}, keras {keras}")
if importlib.util.find_spec("torch"):
    import torch
    frameworks.append(f"torch {torch.__version__}")
framework = ", ".join(frameworks)
horovod = "yes" if importlib.util.find_spec("horovod") else "no"
print(f"sparkhvd {sparkhvd.__version__}, {framework}, numpy {numpy.__version__}, "
      f"pyspark {pyspark.__version__}, horovod {horovod}")
PYEOF
)
say "ready ($PROFILE): $versions"
