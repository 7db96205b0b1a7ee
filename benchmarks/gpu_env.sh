# Sourced by the benchmarks/gpu_*_suite.sh scripts with $out set: multicast off, the wheels in $WHEEL_DIR
# (default .whl) installed without dependencies into /tmp/site, the checkout on PYTHONPATH, and the GPU and
# versions written to $out/gpus.txt.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
wheels="${WHEEL_DIR:-.whl}"
if ls "$wheels"/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$wheels"/*.whl || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD:$PYTHONPATH"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys, torch, transformers, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
} > "$out/gpus.txt" 2>&1
cat "$out/gpus.txt"
