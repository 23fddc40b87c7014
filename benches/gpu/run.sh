#!/usr/bin/env bash
# The GPU suite in one call: CUDA tests, then every GPU benchmark, writing a Markdown summary and
# the benches' JSON under one folder. See benches/gpu/README.md.
#
#   benches/gpu/run.sh [--dry-run | --fast] [--wheels DIR] [--out DIR] [--only STEP ...]
#
# --wheels DIR  a folder of wheels (the dpcore abi3 wheel from .ci/wheel, Opacus, anything the
#               machine lacks), installed offline with --no-deps into a private target folder.
#               The dpcore wheel supplies the compiled core; the Python package is taken from
#               this checkout (python/dpcore), so that Python changes made after the wheel was
#               built are what runs. Without --wheels the installed dpcore is used.
# --out DIR     where the results go (default: $OUT, else ./gpu-results).
# --dry-run     the same steps on the CPU with tiny sizes (a CI test runs it so the script cannot
#               rot); nothing here is a measurement.
# --fast        about 5 minutes: fewer models and steps (when little device time is left).
# --only        run only these steps: tests ops profile torch memory trainer noise users.
#
# Each step has its own time limit, so one hang cannot eat the others' time; a step that fails
# is reported in the summary and the script goes on. Budget on one H100/H200: about 8 minutes.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
dry=0
fast=0
wheels=""
out="${OUT:-}"
only=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry=1 ;;
        --fast) fast=1 ;;
        --wheels) wheels="$2"; shift ;;
        --out) out="$2"; shift ;;
        --only) shift; while [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; do only="$only $1"; shift; done; continue ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
out="${out:-$root/gpu-results}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

if [ -n "$wheels" ]; then
    site=$(mktemp -d)/site
    src=$(mktemp -d)/src
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl || exit 3
    mkdir -p "$src"
    cp -r "$root/python/dpcore" "$src/dpcore"
    cp "$site"/dpcore/_core*.so "$src/dpcore/" || { echo "no dpcore wheel in $wheels" >&2; exit 3; }
    export PYTHONPATH="$src:$site${PYTHONPATH:+:$PYTHONPATH}"
fi

summary="$out/summary.md"
log="$out/log.txt"
: > "$log"
want() { [ -z "$only" ] || [[ " $only " == *" $1 "* ]]; }
t_start=$(date +%s)
{
    echo "# dpcore GPU suite"
    echo
    echo "- date: $(date -u +%Y-%m-%dT%H:%MZ), commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')$( [ -n "$(git -C "$root" status --porcelain 2>/dev/null)" ] && echo ' (with uncommitted changes)')"
    "$py" - <<'EOF'
import platform
try:
    import torch
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device (CPU)"
    print(f"- device: {dev}; torch {torch.__version__}, CUDA {torch.version.cuda}; Python {platform.python_version()}")
except Exception as e:  # noqa: BLE001
    print(f"- torch not importable: {e}")
for name in ("dpcore", "opacus", "transformers", "peft"):
    try:
        m = __import__(name)
        print(f"- {name} {getattr(m, '__version__', '?')} from {m.__file__.rsplit('/', 2)[0]}")
    except Exception as e:  # noqa: BLE001
        print(f"- {name}: not importable ({type(e).__name__})")
EOF
    [ $dry = 1 ] && echo "- **dry run** on the CPU with tiny sizes: nothing below is a measurement"
    echo
} > "$summary"

# step NAME LIMIT_S CMD...: runs CMD under a time limit, its output in the log and the summary.
step() {
    local name=$1 limit=$2
    shift 2
    local t0 rc
    t0=$(date +%s)
    echo "== $name: $*" | tee -a "$log" >&2
    timeout --kill-after=10 "$limit" "$@" > "$out/.step.txt" 2>&1
    rc=$?
    cat "$out/.step.txt" >> "$log"
    {
        echo "## $name"
        echo
        echo "\`$*\` → exit $rc in $(( $(date +%s) - t0 )) s$( [ $rc = 124 ] && echo " (time limit $limit s)")"
        echo
        echo '```'
        # the tables, without the per-child progress lines and warnings
        grep -v -E '^\s*\[ *[0-9]+ s\]|Warning|warnings.warn|^\s*$' "$out/.step.txt" | tail -n 200
        echo '```'
        echo
    } >> "$summary"
    rm -f "$out/.step.txt"
    echo "   exit $rc after $(( $(date +%s) - t0 )) s" >&2
    return 0
}

cd "$root"
if [ $dry = 1 ]; then
    want tests && step "CUDA tests (skipped without a GPU)" 300 "$py" -m pytest -q -m cuda tests/test_cuda.py tests/test_user_level_torch.py -p no:cacheprovider
    want ops && step "bench_step_ops (operators and syncs per step)" 300 "$py" benches/bench_step_ops.py --models cnn \
        --configs non-private dpcore --json "$out/ops.json"
    want profile && step "profile_step" 300 "$py" benches/gpu/profile_step.py --device cpu --models mlp \
        --steps 2 --warmup 1 --top 5
    want torch && step "bench_torch" 300 "$py" benches/bench_torch.py --device cpu --models mlp \
        --configs non-private dpcore dpcore-lean opacus-ghost --steps 2 --min-steps 1 --budget 1 --warmup 1 --rounds 1 \
        --json "$out/torch.json"
    want memory && step "bench_memory" 300 "$py" benches/bench_memory.py --device cpu --models transformer \
        --batches 4 --seq 8 --repeats 1 --steps 1 --configs non-private dpcore dpcore-lean --json "$out/memory.json"
    want trainer && step "bench_trainer" 300 "$py" benches/bench_trainer.py --device cpu --modes lora \
        --steps 2 --warmup 1 --rounds 1 --json "$out/trainer.json"
    want noise && step "bench_device_noise" 120 "$py" benches/bench_device_noise.py --devices cpu \
        --sizes 10000 --blocks 1 --peak-n 10000 --json "$out/noise.json"
    want users && step "bench_user_level (step time)" 300 "$py" benches/bench_user_level.py --quick --skip-accuracy \
        --device cpu --json "$out/users.json"
elif [ $fast = 1 ]; then
    want tests && step "CUDA tests" 90 "$py" -m pytest -q -m cuda tests/test_cuda.py tests/test_user_level_torch.py -p no:cacheprovider --junitxml="$out/cuda-tests.xml"
    want ops && step "bench_step_ops (operators and syncs per step)" 60 "$py" benches/bench_step_ops.py --json "$out/ops.json"
    want profile && step "profile_step (where the time goes)" 45 "$py" benches/gpu/profile_step.py --models transformer \
        --bf16 --steps 10 --warmup 6 --top 12
    want torch && step "bench_torch" 100 "$py" benches/bench_torch.py --device cuda --models transformer cnn \
        --configs non-private dpcore dpcore-lean opacus-hooks opacus-ghost non-private-bf16 dpcore-bf16 \
        --steps 20 --min-steps 5 --budget 1 --warmup 4 --rounds 1 --json "$out/torch.json"
    want trainer && step "bench_trainer (GPT-2 small shape, bf16)" 75 "$py" benches/bench_trainer.py --device cuda \
        --size small --bf16 --modes lora full --steps 5 --warmup 2 --rounds 1 --json "$out/trainer.json"
else
    want tests && step "CUDA tests" 110 "$py" -m pytest -q -m cuda tests/test_cuda.py tests/test_user_level_torch.py -p no:cacheprovider --junitxml="$out/cuda-tests.xml"
    want ops && step "bench_step_ops (operators and syncs per step)" 60 "$py" benches/bench_step_ops.py --json "$out/ops.json"
    want noise && step "bench_device_noise (10^8 float32)" 40 "$py" benches/bench_device_noise.py --devices cuda \
        --sizes 1000000 100000000 --blocks 3 --peak-n 100000000 --json "$out/noise.json"
    want profile && step "profile_step (where the time goes)" 90 "$py" benches/gpu/profile_step.py --models transformer cnn \
        --bf16 --steps 20 --warmup 8 --top 12
    want torch && step "bench_torch (fp32 and bf16 autocast)" 200 "$py" benches/bench_torch.py --device cuda \
        --models transformer cnn lstm mlp --bf16 --steps 30 --min-steps 5 --budget 1 --warmup 4 --rounds 1 \
        --json "$out/torch.json"
    want memory && step "bench_memory (max_memory_allocated)" 150 "$py" benches/bench_memory.py --device cuda \
        --models transformer --batches 32 128 512 1024 --seq 128 --repeats 1 --steps 2 --json "$out/memory.json"
    want trainer && step "bench_trainer (GPT-2 small shape, bf16)" 90 "$py" benches/bench_trainer.py --device cuda \
        --size small --bf16 --modes lora full --steps 10 --warmup 3 --rounds 1 --json "$out/trainer.json"
    want users && step "bench_user_level (user-level step against example-level, transformer)" 60 "$py" \
        benches/bench_user_level.py --skip-accuracy --device cuda --rounds 8 --json "$out/users.json"
fi
echo "total $(( $(date +%s) - t_start )) s" | tee -a "$summary" >&2
