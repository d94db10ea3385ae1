#!/usr/bin/env bash
# Everything a session with a lent GPU measures, in one call (GPUs are lent for minutes):
#   bash benchmarks/gpu_lease.sh OUT_DIR [STEP ...]
# run from the repository root on the GPU machine; STEPs name the steps to run (all if none:
# record record_one_backward record_own gpu_tier learning speedrun flash_tiles_wide flash_tiles;
# their limits add up to more than one 600 s device call, so split them over two calls when the
# lease allows). Wheels in
# .whl/ (what its image lacks: grain, array-record, portpicker, ml-collections, tensorboardX)
# are installed first. Each step has its own time limit and log (OUT_DIR/NAME.log);
# OUT_DIR/summary.txt lists each step's exit status.
# The record-shape step (issue 24, item 6) goes first; if flash_gpu fails there, cudnn is timed
# (also when `record` is named). A step name it does not have, no OUT_DIR, or no nvidia-smi (no
# GPU here) is one `nanotext: error:` line and exit 2, before anything is written.
set -u
STEPS=(record record_one_backward record_own gpu_tier learning speedrun flash_tiles_wide
       flash_tiles)
usage="usage: bash benchmarks/gpu_lease.sh OUT_DIR [STEP ...]; steps: ${STEPS[*]}"
refuse() { echo "nanotext: error: $1" >&2; exit 2; }
case "${1:-}" in
  -h|--help) echo "$usage"; exit 0 ;;
  ""|-*) refuse "no OUT_DIR given; $usage" ;;
esac
out=$1
shift
for name in "$@"; do
  [[ " ${STEPS[*]} " == *" $name "* ]] || refuse "gpu_lease.sh: no step '$name'; $usage"
done
command -v nvidia-smi >/dev/null ||
  refuse "gpu_lease.sh: no nvidia-smi here: run it on the GPU machine"
only=" $* "
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  # pip.log is kept only when the install fails: the device tool brings back 8 files at most
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl >"$out/pip.log" 2>&1; then
    rm -f "$out/pip.log"
  else
    echo "pip: failed" >>"$out/summary.txt"
  fi
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c 'import sys, jax, flax, optax, orbax.checkpoint, grain
print(sys.version.split()[0], "jax", jax.__version__, "flax", flax.__version__, "optax",
      optax.__version__, jax.devices())'
} >"$out/env.txt" 2>&1

step() {  # step NAME SECONDS COMMAND...: run with a limit, log, and note the exit status
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  local asked=$name
  [[ $name == record_cudnn ]] && asked=record  # the record's fallback goes with it
  [[ "$only" == "  " || "$only" == *" $asked "* ]] || return 0
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
  return $rc
}

RECORD=(configs/speedrun_record.yml train.batch_size=1 train.steps=150)
step record 240 python3 benchmarks/gpu_step.py "${RECORD[@]}" --schedule --trace \
  --steps 10 --repeats 3 --json "$out/record.json" --hlo "$out/record.hlo" ||
  step record_cudnn 150 python3 benchmarks/gpu_step.py "${RECORD[@]}" attention.impl=cudnn \
    --steps 10 --repeats 3 --json "$out/record_cudnn.json"
# flash_gpu's backward as one kernel (dq and dk/dv programs, the row term inside) against the
# two kernels of the default: on an H200, 2026-12-04, 20.3 ms a step against 5dffda6's 16.1.
step record_one_backward 150 python3 benchmarks/gpu_step.py "${RECORD[@]}" \
  --own_kernels=flash_gpu_one_backward --steps 10 --repeats 3 --json "$out/record_one_backward.json"
# The same step with nanotext's own kernels that a run takes only opted in (flash_gpu with
# QK-norm, rotation and the value mix inside; the FP8 head's and the MLP's Pallas GEMMs): whether
# they pay yet on a real GPU (on an H200, 2026-12-04: 186.6 ms against 113.3).
step record_own 200 python3 benchmarks/gpu_step.py "${RECORD[@]}" --own_kernels=all --steps 10 \
  --repeats 3 --json "$out/record_own.json"
step gpu_tier 150 env JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -m gpu tests/test_gpu.py -n 0 \
  -p no:cacheprovider
# The real-shape learning check: the whole 150-step schedule at one 49,152-token row, the
# record's 12 layers of 768 (FP8 and bf16 heads, and the PyTorch record on the same rows), on the
# embedded Shakespeare corpus: the GPU machine has no FineWeb, so the head is its 8,192 wide.
# Its first 30 steps took 74 s on an H200 (2026-11-28). JAX would take 75% of the GPU's memory
# up front and leave the PyTorch record too little at the later windows (out of memory at 150
# steps, 2026-11-28): it allocates as it goes here.
step learning 300 env XLA_PYTHON_CLIENT_PREALLOCATE=false \
  python3 benchmarks/learning_check.py --steps=150 \
  --set=train.batch_size=1 --set=data.source=shakespeare --set=data.tokenizer=shakespeare \
  --set=model.vocab_size=8192 --set=train.eval_seq_len=0 --torch_device=cuda
step speedrun 150 python3 benchmarks/gpu_step.py configs/speedrun.yml train.batch_size=1 \
  --steps 10 --repeats 3 --json "$out/speedrun.json"
# speedrun.yml's heads are 256 wide and run at 8 warps: does 4 win there too, as at 128?
step flash_tiles_wide 150 python3 benchmarks/flash_tiles.py 5 --wide
step flash_tiles 200 python3 benchmarks/flash_tiles.py 5
exit 0
