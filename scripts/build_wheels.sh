#!/usr/bin/env bash
# Build the folder of wheels that the GPU machine (no network, Python 3.12, its own torch and
# triton) needs to run KernelArc: mlflow-skinny, sqlalchemy, alembic, hydra-core, omegaconf,
# anthropic, pydantic, safetensors, pytest (for the GPU-marked tests) and their pure dependencies.
# Never torch or triton.
# Usage: scripts/build_wheels.sh [DIR]   (default .whl, git-ignored; under 64 MiB)
set -euo pipefail
DIR="${1:-.whl}"
mkdir -p "$DIR"
python3 -m pip wheel -q --no-deps -w "$DIR" antlr4-python3-runtime==4.9.3
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any --find-links "$DIR" -d "$DIR" \
  mlflow-skinny==3.17.2 sqlalchemy alembic hydra-core==1.3.8 anthropic==2.14.0 pydantic safetensors pytest
# The image has its own torch/triton/numpy stack: drop anything that would shadow it.
rm -f "$DIR"/torch-* "$DIR"/triton-* "$DIR"/numpy-* "$DIR"/nvidia_* "$DIR"/sympy-* "$DIR"/networkx-* "$DIR"/jinja2-* "$DIR"/MarkupSafe-* "$DIR"/fsspec-* "$DIR"/filelock-* "$DIR"/setuptools-*
# CUTLASS C++ headers for the CUTLASS family, after the cleanup above (it drops nvidia_*) (built with the image's nvcc; Python parts unused)
python3 -m pip download -q --no-deps --only-binary=:all: -d "$DIR" nvidia-cutlass==4.2.0.0
du -sh "$DIR"; ls "$DIR" | wc -l
