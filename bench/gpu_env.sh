# Sourced by bench/*_gpu.sh and bench/multi_gpu.sh:  . "$(dirname "$0")/gpu_env.sh" DEFAULT_OUT
# Sets OUT (the caller's, else DEFAULT_OUT; created) and PY (python3 unless set), makes Python's output
# unbuffered, puts the checkout on PYTHONPATH (keeping a wheel folder the caller put there) and prints
# the GPU, torch, triton and CUDA versions for the log.
OUT=${OUT:-$1}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
