#!/usr/bin/env bash
# The hash of the sources that decide a synthetic checkpoint's bytes (glm53 synth: glm53/synth,
# glm53/models, the chat template it ships): a checkpoint carried to the GPU machine
# (tools/carry-checkpoint.sh) is used there only while this hash is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
find glm53/synth glm53/models glm53/chat -type f \( -name '*.py' -o -name '*.jinja' \) | sort |
  xargs cat | sha1sum | cut -c1-16
