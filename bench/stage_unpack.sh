#!/usr/bin/env bash
# One staged piece: copy it into DEST (default ~/eyas-stage) and reassemble every file whose pieces have all
# arrived, checking its sha256. Written next to each piece by bench/stage_wheels.py's pack (stage_vllm.py,
# stage_sglang.py), in the format of stage.py's pieces.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=${1:-$HOME/eyas-stage}
mkdir -p "$dest/.pieces"
cp "$here"/*.piece "$dest/.pieces/" 2>/dev/null || true
python3 - "$dest" "$here/manifest.json" <<'PY'
import hashlib, json, os, sys
dest, manifest = sys.argv[1], json.load(open(sys.argv[2]))
pieces = os.path.join(dest, ".pieces")
for name, info in manifest.items():
    out = os.path.join(dest, name)
    if os.path.exists(out) and os.path.getsize(out) == info["size"]:
        continue
    parts = [os.path.join(pieces, p) for p in info["pieces"]]
    missing = sum(not os.path.exists(p) for p in parts)
    if missing:
        print(f"{name}: {missing} piece(s) still to come")
        continue
    os.makedirs(os.path.dirname(out), exist_ok=True)
    digest = hashlib.sha256()
    with open(out + ".part", "wb") as f:
        for p in parts:
            with open(p, "rb") as src:
                data = src.read()
            digest.update(data)
            f.write(data)
    if digest.hexdigest() != info["sha256"]:
        os.remove(out + ".part")
        sys.exit(f"{name}: sha256 differs from the manifest's; send its pieces again")
    os.replace(out + ".part", out)
    for p in parts:
        os.remove(p)
    print(f"ready: {out} ({info['size']} bytes)")
PY
