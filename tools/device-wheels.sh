#!/usr/bin/env bash
# The test wheels the GPU machine's image lacks, for tools/gpu-check.sh's DEVICE_DIR/wheels312/:
#   tools/device-wheels.sh DEVICE_DIR
# Run here (where pip reaches the package index); the GPU machine has no network. Versions come
# from .ci/constraints.txt, so the GPU suite's openai client is the one CI tests with. The image
# (Python 3.12) has httpx, h11, pydantic and typing-extensions; openai 3.57 also needs these.
set -euo pipefail
DEV=${1:?usage: tools/device-wheels.sh DEVICE_DIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$DEV/wheels312"
for name in openai anyio httpx2 httpcore2 h11 idna jiter sniffio truststore; do
  pin=$(grep -i "^${name}==" "$REPO/.ci/constraints.txt") || { echo "no pin for $name" >&2; exit 1; }
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DEV/wheels312" "$pin"
done
ls "$DEV/wheels312"
