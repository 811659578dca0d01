#!/usr/bin/env bash
# Installs into SITE the wheels of DIR whose distribution SITE does not hold yet (beside vLLM's
# carried site, only what it lacks, such as gguf: its own versions stay), without the network;
# prints their file names. Used by gpu_env.sh (.whl/) and wheels_carry.sh (a joined carry).
#   bash scripts/install_wheels.sh SITE DIR
set -euo pipefail
site=$1; dir=$2
missing=$(python3 - "$site" "$dir" <<'PY'
import pathlib, re, sys
norm = lambda name: re.sub(r"[-_.]+", "_", name).lower()
site, wheels = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
have = {norm(d.name.split("-")[0]) for d in site.glob("*.dist-info")}
print(" ".join(str(w) for w in sorted(wheels.glob("*.whl")) if norm(w.name.split("-")[0]) not in have))
PY
)
[ -n "$missing" ] || exit 0
# shellcheck disable=SC2086  # one path per word
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" $missing
# shellcheck disable=SC2086
basename -a $missing
