#!/usr/bin/env bash
# Replace the committed demo results (docs/smollm2_demo.json, docs/smollm2_demo.png) with a finished run's
# summary (written by run.sh into RUN_DIR). Explicit on purpose: a user's run never touches tracked files.
#   bash examples/smollm2/update_docs.sh RUN_DIR
set -euo pipefail
RUN_DIR=${1:?usage: bash examples/smollm2/update_docs.sh RUN_DIR}
repo=$(cd "$(dirname "$0")/../.." && pwd)
# the names summarize.py writes under (mtrain/run_files.py), from this checkout
names=$(PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH} "${PYTHON:-python3}" -c \
    "from mtrain.run_files import SUMMARY_FILE, SUMMARY_PLOT; print(SUMMARY_FILE, SUMMARY_PLOT)")
read -r json png <<< "$names"
for f in "$json" "$png"; do
    [ -f "$RUN_DIR/$f" ] || { echo "update_docs: $RUN_DIR/$f missing (run examples/smollm2/run.sh first)" >&2; exit 2; }
done
RUN_DIR=$(cd "$RUN_DIR" && pwd)
cd "$repo"
cp "$RUN_DIR/$json" docs/smollm2_demo.json
cp "$RUN_DIR/$png" docs/smollm2_demo.png
echo "updated docs/smollm2_demo.json and docs/smollm2_demo.png from $RUN_DIR"
