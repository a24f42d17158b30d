#!/usr/bin/env bash
# Make what bench/device.sh carries to the GPU machine, which reaches no package registry (run it here):
#   .whl/           Python 3.12 x86-64 wheels of the dependencies that machine's image lacks, at the versions
#                   this checkout's venv runs (so both machines run the same code), without their own deps;
#   .device/smollm2 the embedded model's config, tokenizer, chat template and generation config (no weights).
# Both folders are git-ignored; name them in `carry`.
#
#   bash bench/device_prepare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
WHL=${WHL:-.whl}
MODEL_FILES=${MODEL_FILES:-.device/smollm2}
# What the image lacks (its torch, transformers, click, psutil, httpx, uvloop, numpy, matplotlib do); jinja2 in case
# it came with transformers' extras only: the API servers render chat templates with it directly; py-spy for
# bench/serve.py --profile-api-server.
PACKAGES="atomicshm uvicorn starlette pyzmq orjson pydantic pydantic-core annotated-types typing-inspection typing-extensions
setproctitle httptools h11 anyio sniffio jinja2 markupsafe py-spy"

# NAME==VERSION as installed in the venv, else the bare name (the newest).
pinned() {
  "$PY" - "$@" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(name)
EOF
}

rm -rf "$WHL"
mkdir -p "$WHL"
# shellcheck disable=SC2046  # one requirement per word
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$WHL" $(pinned $PACKAGES)

# pydantic pins the exact pydantic-core it was built with: check that the two wheels agree.
"$PY" - "$WHL" <<'EOF'
import glob, re, sys, zipfile
wheel = glob.glob(f"{sys.argv[1]}/pydantic-[0-9]*.whl")[0]
meta = zipfile.ZipFile(wheel).read(next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith("METADATA")))
need = re.search(rb"Requires-Dist: pydantic-core\s*==\s*([\w.]+)", meta).group(1).decode()
have = glob.glob(f"{sys.argv[1]}/pydantic_core-{need}-*.whl")
sys.exit(0 if have else f"pydantic needs pydantic-core=={need}, not among the wheels")
EOF

model_dir=$("$PY" -m enginecore.model_source | tail -1)
rm -rf "$MODEL_FILES"
mkdir -p "$MODEL_FILES"
cp "$model_dir"/*.json "$model_dir"/*.jinja "$MODEL_FILES"/
echo "wheels in $WHL ($(du -sh "$WHL" | cut -f1)): $(ls "$WHL" | wc -l)"
echo "model files in $MODEL_FILES (from $model_dir): $(ls "$MODEL_FILES" | tr '\n' ' ')"
