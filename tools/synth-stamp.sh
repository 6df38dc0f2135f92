#!/usr/bin/env bash
# The hash of the sources that decide a synthetic checkpoint's bytes (glm53 synth: glm53/synth,
# glm53/models, the chat template it ships): a checkpoint carried to the GPU machine
# (tools/carry-checkpoint.sh) is used there only while this hash is unchanged.
#   tools/synth-stamp.sh          the hash
#   tools/synth-stamp.sh --files  each file's sha1 and path, the list the hash is taken over
# (carried beside the hash, so that a mismatch on the GPU machine names the files that differ:
# on 2026-12-05 the H200's copy of the tree hashed otherwise than here, cause not found)
set -euo pipefail
cd "$(dirname "$0")/.."
files() {
  find glm53/synth glm53/models glm53/chat -type f \( -name '*.py' -o -name '*.jinja' \) |
    LC_ALL=C sort
}
if [ "${1:-}" = --files ]; then
  files | xargs sha1sum
else
  files | xargs cat | sha1sum | cut -c1-16
fi
