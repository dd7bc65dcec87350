#!/usr/bin/env bash
# What the open issues still owe a GPU, in one run sized for a lent device's 15 minutes (run it once, as is):
#   issue 46: the slot arena's decode step at 1 stream (profiled: is the new row written in place?) and at 32,
#             against the bandwidth floor (python -m benchmarks streams --shape ..., one process per N);
#   issue 49: what linking costs per reuse mode at the 7B shape (python -m benchmarks link_time --shape ...);
#   the CUDA tests (tests/test_cuda.py).
# On the device:  bash benchmarks/gpu_session.sh "$OUT"        (7B fp16 shape on cuda)
# Dry run first:  SHAPE=llama-tiny DEVICE=cpu bash benchmarks/gpu_session.sh /tmp/dry
# transformers at the tested pin, where the device lacks it: `pip download --no-deps -d .whl transformers==5.23.0`
# here, then carry .whl; the script installs it into /tmp/site. Each step has its own time limit (STEP_S seconds)
# and a failing step does not stop the others; the exit status says whether all passed.
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_session.sh OUT}
shape=${SHAPE:-vicuna-7b}
device=${DEVICE:-cuda}
limit=${STEP_S:-200}
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
    pip install -q --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PWD"
fi
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
failed=0
step() {  # step NAME COMMAND...: its output's tail, its status kept
    local name=$1
    shift
    echo "== $name"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$out/$name.log"
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" = 0 ] || failed=1
}
step streams_1 env STREAMS=1 PROFILE=1 COMPILE_MODE=reduce-overhead \
    python -m benchmarks streams --shape "$shape" --device "$device" --out "$out/streams_1"
step streams_32 env STREAMS=32 COMPILE_MODE=reduce-overhead \
    python -m benchmarks streams --shape "$shape" --device "$device" --out "$out/streams_32"
step link_time python -m benchmarks link_time --shape "$shape" --device "$device" --rounds 5 --out "$out/link_time"
if [ "$device" = cuda ]; then
    step test_cuda python -m pytest -q -p no:cacheprovider tests/test_cuda.py
fi
exit $failed
