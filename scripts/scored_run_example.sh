#!/usr/bin/env bash
# The published scored run (evidence/scored_run/), played so that git shows its commitment existed
# before its play: the server opens the run and publishes its commitment; this script commits it to
# git (evidence/scored_run/commitment.json, a commit of that file alone); the entrant's nonce is that
# commit's hash, so no world of the run could be drawn before the commit existed; then the heuristic
# plays the run, and its ledger, reveal, receipts and scorecard go into evidence/scored_run/ for a
# second commit. Run from a clean checkout (the run records the code's commit).
#   scripts/scored_run_example.sh PYTHON BUILD_DIR EVIDENCE_DIR AGENT
set -euo pipefail
py=$1 build=$2 evidence=$3 agent=$4
if ! git diff --quiet HEAD --; then
  echo "error: the checkout has uncommitted changes: commit them first (the run records the code's commit)" >&2
  exit 2
fi
rm -rf "$build" && mkdir -p "$build"
"$py" -m lib.measure.score_agent --agent "$agent" --suite v3 --out "$build/out" \
  --commitment-file "$build/commitment.json" --nonce-file "$build/nonce" &
player=$!
trap 'kill "$player" 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  [ -s "$build/commitment.json" ] && break
  kill -0 "$player" 2>/dev/null || { echo "error: the scored run did not start" >&2; exit 1; }
  sleep 0.5
done
[ -s "$build/commitment.json" ] || { echo "error: no commitment within 300 s" >&2; exit 1; }
mkdir -p "$evidence"
cp "$build/commitment.json" "$evidence/commitment.json"
git add "$evidence/commitment.json"
git commit -q -m "evidence/scored_run: the commitment of the next published scored run, committed before its play (its entrant's nonce is this commit's hash)" -- "$evidence/commitment.json"
git rev-parse HEAD > "$build/nonce.tmp" && mv "$build/nonce.tmp" "$build/nonce"
echo "commitment committed in $(cat "$build/nonce"); the run is played with that hash as its entrant's nonce"
wait "$player"
trap - EXIT
out=$build/out
find "$evidence" -mindepth 1 ! -name commitment.json -delete
gzip -9n < "$(ls "$out"/*[0-9a-f].jsonl)" > "$evidence/ledger.jsonl.gz"
cp "$out"/*.reveal.json "$evidence/reveal.json"
cp "$out"/*.receipts.json "$evidence/receipts.json"
cp "$out"/scorecard-*.json "$evidence/scorecard.json"
cp "$out"/scorecard-*.md "$evidence/scorecard.md"
echo "played: commit $evidence/ (its ledger, reveal, receipts and scorecard) in a second commit"
