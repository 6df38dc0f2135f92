#!/usr/bin/env bash
# tools/carry-checkpoint.sh DEVICE_DIR [PRESET]: write a synthetic checkpoint here, on the CPU
# (`glm53 synth --preset PRESET --routing glm53`, the command tools/gpu-check.sh runs; default
# demo), and pack it as DEVICE_DIR/ckpt-PRESET.tar.gz with tools/synth-stamp.sh's hash inside.
# tools/gpu-check.sh unpacks it instead of synthesizing while the hash matches its sources. The
# demo is the one worth carrying: 24 MB (22 MB packed), 23 s on a 2-core EPYC, but 112-127 s on
# the GPU machines, whose torch decodes its router fit on one slower CPU thread (H200 and H100,
# 2026-12-05); the same seed gives the same bytes on any machine with the same torch.
set -euo pipefail
DEV=$(realpath "${1:?usage: tools/carry-checkpoint.sh DEVICE_DIR [PRESET]}")
PRESET=${2:-demo}
REPO=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m glm53 synth --preset "$PRESET" --routing glm53 --out "$tmp/$PRESET" >"$tmp/synth.log"
"$REPO/tools/synth-stamp.sh" >"$tmp/$PRESET/.glm53-synth-stamp"
"$REPO/tools/synth-stamp.sh" --files >"$tmp/$PRESET/.glm53-synth-files"
tar -czf "$DEV/ckpt-$PRESET.tar.gz" -C "$tmp" "$PRESET"
echo "$DEV/ckpt-$PRESET.tar.gz: $(du -h "$DEV/ckpt-$PRESET.tar.gz" | cut -f1), stamp $(cat "$tmp/$PRESET/.glm53-synth-stamp")"
