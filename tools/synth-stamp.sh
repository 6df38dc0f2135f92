#!/usr/bin/env bash
# The hash of the sources that decide a synthetic checkpoint's bytes (glm53 synth: glm53/synth,
# glm53/models, the chat template it ships): a checkpoint carried to the GPU machine
# (tools/carry-checkpoint.sh) is used there only while this hash is unchanged.
#   tools/synth-stamp.sh          the hash
#   tools/synth-stamp.sh --files  each file's sha1 and path, the list the hash is taken over
# (carried beside the hash, so that a mismatch on the GPU machine names the files that differ).
# The list is sorted bytewise (LC_ALL=C): on 2026-12-05 the H200 hashed the same files in its
# locale's order (2c325fc84e56d604 against e952b2981feb87af here: "__init__.py" after
# "chat_template.jinja"), so the carried demo was refused and synthesized again.
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
