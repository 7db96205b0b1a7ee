# Sourced by the benchmarks/gpu_*_suite.sh scripts with $out set: multicast off, the wheels in $WHEEL_DIR
# (default .whl) installed without dependencies into /tmp/site, the checkout on PYTHONPATH, and the GPU and
# versions (optional packages: whether they import) written to $out/gpus.txt.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
wheels="${WHEEL_DIR:-.whl}"
if ls "$wheels"/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$wheels"/*.whl || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD:$PYTHONPATH"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 - <<'EOF'
import importlib
import sys

versions = [sys.version.split()[0]]
for name in ("torch", "transformers", "accelerate", "deepspeed", "triton", "fla", "cudnn"):
    try:
        versions.append(f"{name} {getattr(importlib.import_module(name), '__version__', '?')}")
    except Exception:  # optional packages: say so instead of failing
        versions.append(f"{name} not importable")
print(", ".join(versions))
EOF
} > "$out/gpus.txt" 2>&1
cat "$out/gpus.txt"
