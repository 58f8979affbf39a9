#!/usr/bin/env bash
# Render a `smolctl report --html` file to a PNG with headless Chromium (Debian's `chromium` package), to check
# that the report opens in a real browser with its plots: nothing is fetched, the page is one file.
#   smolctl report demo-out/pretrain --html demo-out/report.html && scripts/render_report.sh demo-out/report.html demo-out/report.png
set -euo pipefail
HTML=$(realpath "$1")
PNG=$(realpath -m "$2")
BROWSER=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$BROWSER" ]; then
  echo "error: chromium is not installed — apt-get install -y chromium" >&2
  exit 2
fi
PROFILE=$(mktemp -d)
trap 'rm -rf "$PROFILE"' EXIT
timeout 120 "$BROWSER" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync --user-data-dir="$PROFILE" \
  --hide-scrollbars --window-size=1200,1600 --screenshot="$PNG" "file://$HTML" >/dev/null 2>&1
test -s "$PNG"
echo "$PNG"
