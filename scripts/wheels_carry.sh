#!/usr/bin/env bash
# Wheels too large for one GPU-machine call (a call carries 64 MiB in all, the tree included),
# in parts of at most 48 MiB, one call each, installed into /tmp/site after the last:
# FlashAttention 4 (flash-attn-4, NVIDIA's CuTe DSL: its Python package is libs-core, its
# compiler libs-cu13; ~108 MB) for benchmarks/unified_attention.py's FA4 column,
# or Ray (~80 MB) for its GPU tests.
#   here:        bash scripts/wheels_carry.sh split NAME WHEEL...   -> .carry/NAME/part1..N
#                (the wheels of one folder)
#                (fa4: bash scripts/wheels_carry.sh fetch-fa4 downloads and splits them)
#   GPU call I:  carry [".carry/NAME/partI"]; bash scripts/wheels_carry.sh take NAME I
#                -> after the last part, the wheels whose distribution /tmp/site lacks are
#                installed there (`gpu_env.sh` puts /tmp/site on PYTHONPATH). Calls back to
#                back: /tmp stays while the machine is warm (~30 s after a call).
set -euo pipefail
PART_BYTES=$((48 << 20))
SITE=${SITE:-/tmp/site}
case "${1:-}" in
  split)
    name=$2; shift 2
    out=.carry/$name; rm -rf "$out"; mkdir -p "$out"
    tar -cf "$out/wheels.tar" -C "$(dirname "$1")" $(for w in "$@"; do basename "$w"; done)
    sha=$(sha256sum "$out/wheels.tar" | cut -d' ' -f1)
    split -b "$PART_BYTES" -d -a 1 "$out/wheels.tar" "$out/wheels.tar."
    rm "$out/wheels.tar"
    n=$(ls "$out"/wheels.tar.* | wc -l)
    for i in $(seq "$n"); do
      mkdir "$out/part$i" && mv "$out/wheels.tar.$((i - 1))" "$out/part$i/"
      echo "$n $sha" > "$out/part$i/parts"
    done
    du -sh "$out"/part* ;;
  fetch-fa4)  # FlashAttention 4 for the GPU machine's Python 3.12 and CUDA 13
    d=$(mktemp -d)
    pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d "$d" \
      flash-attn-4==4.0.0b40 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
      nvidia-cutlass-dsl-libs-cu13==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
      quack-kernels==0.6.5 einops==0.8.1 torch-c-dlpack-ext==0.1.5 apache-tvm-ffi==0.1.15.post2 \
      cuda-bindings==13.5.0 cuda-pathfinder==1.9.1 protobuf==6.33.2
    bash "$0" split fa4 "$d"/*.whl
    rm -rf "$d" ;;
  take)
    name=$2; i=$3; dst=/tmp/carry/$name
    mkdir -p "$dst" && cp ".carry/$name/part$i/"wheels.tar.* "$dst/"
    read -r n sha < ".carry/$name/part$i/parts"
    have=$(ls "$dst"/wheels.tar.* | wc -l)
    if [ "$have" -lt "$n" ]; then echo "$name: $have of $n parts here"; exit 0; fi
    cat $(ls "$dst"/wheels.tar.* | sort) > "$dst/wheels.tar"
    echo "$sha  $dst/wheels.tar" | sha256sum -c --quiet
    mkdir -p "$dst/wheels" && tar -xf "$dst/wheels.tar" -C "$dst/wheels"
    rm "$dst"/wheels.tar*
    installed=$(bash "$(dirname "$0")/install_wheels.sh" "$SITE" "$dst/wheels")
    echo "$name: installed into $SITE:" $installed ;;
  *)
    awk 'NR > 1 { if (!/^#/) exit; print }' "$0"; exit 2 ;;  # the header's comment lines
esac
