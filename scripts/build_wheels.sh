#!/usr/bin/env bash
# Build the folder of wheels that the GPU machine (no network, Python 3.12, its own torch and
# triton) needs to run KernelArc: mlflow-skinny, sqlalchemy, alembic, hydra-core, omegaconf,
# anthropic, pydantic, safetensors, rich, pytest (for the GPU-marked tests) and their pure dependencies.
# Never torch or triton. (mlflow-skinny is enough there: tracking, the registry and writing a version's
# MLflow model files; loading one with mlflow.pyfunc needs pandas, i.e. the full package.)
# Usage: scripts/build_wheels.sh [DIR]   (default .whl, git-ignored; under 64 MiB)
#        scripts/build_wheels.sh --ray [DIR]   (default .whl-ray: Ray and its dependencies, ~45 MB, carried on
#        its own: with .whl it would pass the 64 MiB a device call carries)
set -euo pipefail
PLATFORMS=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
if [ "${1:-}" = "--ray" ]; then
  DIR="${2:-.whl-ray}"
  mkdir -p "$DIR"
  python3 -m pip download -q "${PLATFORMS[@]}" -d "$DIR" "ray>=2.58,<3"
  rm -f "$DIR"/numpy-* "$DIR"/setuptools-* "$DIR"/filelock-*
  # The wheel is ~76 MB; without its Java worker jar (ray/jars, unused by Python actors) and the
  # dashboard's source maps it is ~45 MB. RECORD loses the same lines (pip does not check the others).
  python3 - "$DIR" <<'EOF'
import sys, zipfile
from pathlib import Path
for whl in Path(sys.argv[1]).glob("ray-*.whl"):
    drop = lambda n: n.startswith("ray/jars/") or n.endswith(".js.map")
    slim = whl.with_suffix(".slim")
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if drop(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(l for l in data.splitlines(True) if not drop(l.split(b",", 1)[0].decode()))
            dst.writestr(info, data)
    slim.replace(whl)
EOF
  du -sh "$DIR"; ls "$DIR" | wc -l
  exit 0
fi
DIR="${1:-.whl}"
mkdir -p "$DIR"
python3 -m pip wheel -q --no-deps -w "$DIR" antlr4-python3-runtime==4.9.3
python3 -m pip download -q "${PLATFORMS[@]}" --find-links "$DIR" -d "$DIR" \
  mlflow-skinny==3.17.2 sqlalchemy alembic hydra-core==1.3.8 anthropic==2.14.0 pydantic safetensors rich pytest
# The image has its own torch/triton/numpy stack: drop anything that would shadow it.
rm -f "$DIR"/torch-* "$DIR"/triton-* "$DIR"/numpy-* "$DIR"/nvidia_* "$DIR"/sympy-* "$DIR"/networkx-* "$DIR"/jinja2-* "$DIR"/MarkupSafe-* "$DIR"/fsspec-* "$DIR"/filelock-* "$DIR"/setuptools-*
# CUTLASS C++ headers for the CUTLASS family, after the cleanup above (it drops nvidia_*) (built with the image's nvcc; Python parts unused)
python3 -m pip download -q --no-deps --only-binary=:all: -d "$DIR" nvidia-cutlass==4.2.0.0
# CUPTI activity records for the guard's timing (kernelarc/guard/timer.py; CUDA events without it)
python3 -m pip download -q --no-deps "${PLATFORMS[@]}" -d "$DIR" cupti-python==13.0.1
du -sh "$DIR"; ls "$DIR" | wc -l
