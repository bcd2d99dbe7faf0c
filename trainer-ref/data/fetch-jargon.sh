#!/usr/bin/env bash
# Re-creates data/jargon.txt.gz from Debian's `jargon-text` package (4.4.7-4.1), the corpus the built-in
# recipes train on. Needs network access to a Debian mirror; the trainer itself never fetches anything.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
apt-get download jargon-text
dpkg-deb -x jargon-text_*_all.deb x
cp x/usr/share/doc/jargon-text/jargon.txt.gz "$here/jargon.txt.gz"
sha256sum "$here/jargon.txt.gz"
