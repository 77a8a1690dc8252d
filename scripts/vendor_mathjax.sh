#!/usr/bin/env bash
# Fetch MathJax 3 from the npm registry into the git-ignored docs/javascripts/vendor/ so the
# docs site renders math without internet at view time. Third-party code is never committed.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=docs/javascripts/vendor/mathjax
[ -f "$DEST/tex-svg-full.js" ] && exit 0
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
(cd "$TMP" && npm pack --silent mathjax@3 >/dev/null && tar xzf mathjax-*.tgz)
mkdir -p "$DEST"
cp "$TMP/package/es5/tex-svg-full.js" "$DEST/tex-svg-full.js"
cp "$TMP/package/LICENSE" "$DEST/LICENSE"
