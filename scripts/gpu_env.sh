# Sourced by scripts/gpu_*.sh on the GPU machine, from the repository root: $OUT (created),
# $R (a fresh scratch folder), the environment (the package from src/, no hub, no NVLink
# multicast, as on the target machines) and $B, the bench command.
OUT=${OUT:-/tmp/gpu_out}; R=$(mktemp -d); mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=src
# Wheels the machine lacks (scripts/README.md lists them), carried in .whl/ (`carry: [".whl"]`):
# those of distributions /tmp/site does not hold yet (beside vLLM's carried site, only what it
# lacks, such as gguf: its own versions stay).
SITE=${SITE:-/tmp/site}
bash "$(dirname "${BASH_SOURCE[0]}")/install_wheels.sh" "$SITE" .whl >/dev/null
# $SITE stays while the machine is warm: what an earlier call put there (the wheels, the
# default model from scripts/default_model_carry.sh) serves later calls too.
export PYTHONPATH=src:$SITE  # scripts give another tree's src in place of src: ${PYTHONPATH#src:}
# NVIDIA's CuTe DSL (FlashAttention 4's, scripts/wheels_carry.sh) is found through a .pth file,
# which folders on PYTHONPATH do not run: its folder goes on the path here.
if [ -d "$SITE/nvidia_cutlass_dsl/dsl_packages" ]; then
  export PYTHONPATH=$PYTHONPATH:$SITE/nvidia_cutlass_dsl/dsl_packages
fi
# gguf is a dependency the machine lacks: without it nothing of the package imports (a server
# then dies while starting, a bench at its first import). Say so now, not minutes later.
python3 -c "import gguf" 2>/dev/null || echo "gpu_env.sh: gguf does not import: carry .whl" \
  "(scripts/README.md)" >&2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
B="python3 src/llm_inference/entrypoints/bench.py"
