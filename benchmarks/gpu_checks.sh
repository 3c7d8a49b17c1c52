#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one script sized for a short lease (about 8 minutes on one
# H100/H200): fine-tuning under AMP (bf16 and fp16) with EMA, eval on the GPU, the TPS overhead
# and headline benchmarks in float32 and under bf16 autocast, and dtps's overhead under
# torch.compile (inductor). Results go to $OUT (default ./gpu-out): one log, JSON per benchmark.
#
#   OUT=gpu-out bash benchmarks/gpu_checks.sh
#   OUT=gpu-out PARTS=finetune bash benchmarks/gpu_checks.sh   # only the fine-tuning checks
#   OUT=gpu-out PARTS="compiled sweep" bash benchmarks/gpu_checks.sh   # issue 13's GPU part
#
# PARTS: finetune, bench (the default pair), compiled (eager vs compiled alike, COMPILE_MODE,
# default reduce-overhead: CUDA graphs), sweep (bench --batch-sizes on the GPU), resume (a bf16
# finetune through Accelerate stopped by SIGTERM, then resumed), windowed (compressed Swin-T
# against Swin-T, every method at keep 0.7), ladder (benchmarks/gpu_ladder.py: 6 models, every
# method, eager and graphed (CUDA graphs captured without a compiler), against base and ideal
# slicing, two processes), ladder-compiled (its inductor cells, a lease of their own),
# ladder-multiple (the eager ladder with --kept-multiple 8, its own lease), ladder-fused (eager
# and graphed bf16 with the fused Triton kernels instead of the method's ops: after kernels has
# passed), spread (the bf16 headline in four fresh processes, seeds 0 0 1 2, and at batch 1024,
# with each model's host share: benchmarks/results/h200_bf16_spread.md, about 4 minutes),
# kernels (the Triton select_squeeze and tome_merge compiled on CUDA: tests/test_triton_cuda.py,
# and their speed against the method's ops, about 3 minutes), graphs (--cuda-graphs: its tests on
# CUDA, apply with it on deit_small + dTPS, and Swin-T's graphed cells, about 3 minutes),
# compiled-kernels (the kernels one compiled forward launches at batch 1, base and each method:
# benchmarks/compiled_kernels.py on CUDA, about 3 minutes). COMPILE_VARIANTS narrows the
# compiled part.
#
# A 15-minute lease (a machine's start takes one to two). Run 8 ran PARTS=ladder
# LADDER_SECONDS=200 (6.5 minutes) and PARTS=kernels (1.2). Next: PARTS="graphs compiled-kernels"
# (about 6), then, warm, PARTS=ladder-compiled with LADDER_SECONDS=110 (about 5), then
# PARTS=ladder-multiple with what is left.
#
# Runs from the repository root without installing the package (PYTHONPATH=.), so a machine
# with torch, timm, accelerate, click, rich, safetensors and pyyaml needs nothing else.
set -uo pipefail
OUT=${OUT:-gpu-out}
PARTS=${PARTS:-finetune bench}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
cli() { python3 -c "from vitcompress.cli.main import main; main()" "$@"; }
step() { echo; echo "=== $* ($(date +%T))"; }
status=0
check() { "$@" || { echo "FAILED ($?): $*"; status=1; }; }
gpu_tests() {  # one test file on this machine's GPU, where pytest is installed
    if python3 -c "import pytest" 2>/dev/null; then
        check timeout 180 python3 -m pytest -q -p no:cacheprovider "$1"
    else
        echo "FAILED: pytest is not installed here (pip install pytest)"; status=1
    fi
}

step environment
nvidia-smi -L
python3 -c "import torch, timm, accelerate; print('torch', torch.__version__, 'timm', timm.__version__, 'accelerate', accelerate.__version__, torch.cuda.get_device_name())"

if [[ " $PARTS " == *" finetune "* || " $PARTS " == *" resume "* ]]; then
step "a small ImageFolder (random images, 2 classes)"
python3 - "$OUT/data" <<'EOF'
import sys
from pathlib import Path
import numpy as np
from PIL import Image
rng = np.random.default_rng(0)
for split, count in (("train", 64), ("val", 32)):
    for label in ("a", "b"):
        folder = Path(sys.argv[1], split, label)
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            pixels = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
            if label == "b":
                pixels[:32] //= 4  # a learnable difference
            Image.fromarray(pixels).save(folder / f"{i}.png")
EOF

fi
if [[ " $PARTS " == *" resume "* ]]; then
# Issue 24: a GPU fine-tune interrupted the way a scheduler does it (SIGTERM), then resumed.
# The first run must exit non-zero after checkpointing; the resumed run must finish every epoch.
step "finetune deit_tiny dtps, --amp bf16, stopped by SIGTERM after its first steps"
rm -rf "$OUT/ft_resume"
# python itself in the background (not the cli function's subshell), so the signal reaches it
python3 -c "from vitcompress.cli.main import main; main()" finetune --model deit_tiny_patch16_224 \
    --model-arg num_classes=2 --variant dtps --keep 0.7 --data "$OUT/data" --epochs 3 --batch-size 16 --warmup-epochs 0.5 --amp bf16 \
    --out "$OUT/ft_resume" --json > "$OUT/ft_resume_first.json" &
pid=$!
for _ in $(seq 1 240); do  # wait (up to 120 s) for the first logged steps, then stop the run
    [[ -s "$OUT/ft_resume/metrics.jsonl" ]] && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.5
done
sleep 2
kill -TERM $pid 2>/dev/null && echo "SIGTERM sent to $pid"
wait $pid; first=$?
echo "first run exit code: $first (non-zero expected)"
[[ $first -ne 0 ]] || { echo "FAILED: the interrupted run exited 0"; status=1; }
ls "$OUT/ft_resume/checkpoints" || { echo "FAILED: no checkpoint"; status=1; }
step "resume it"
check cli finetune --model deit_tiny_patch16_224 --model-arg num_classes=2 --variant dtps \
    --keep 0.7 --data "$OUT/data" --epochs 3 --batch-size 16 --warmup-epochs 0.5 --amp bf16 \
    --out "$OUT/ft_resume" --resume --json > "$OUT/ft_resume_second.json"
python3 -c 'import json, sys; print(json.dumps(json.load(open(sys.argv[1])), indent=1)[:3000])' \
    "$OUT/ft_resume_second.json"
fi
if [[ " $PARTS " == *" finetune "* ]]; then
for amp in bf16 fp16; do
    step "finetune deit_tiny dtps on the GPU, --amp $amp, EMA"
    check cli finetune --model deit_tiny_patch16_224 --model-arg num_classes=2 --variant dtps \
        --keep 0.7 --data "$OUT/data" \
        --epochs 2 --batch-size 32 --warmup-epochs 0.5 --amp $amp --ema-decay 0.9 \
        --out "$OUT/ft_$amp" --json
    step "eval the $amp run on the GPU against its base"
    check cli eval --model "$OUT/ft_$amp" --data "$OUT/data" --device cuda --batch-size 32 \
        --base deit_tiny_patch16_224 --json
done
fi
rm -rf "$OUT/data" "$OUT"/ft_*/checkpoints


if [[ " $PARTS " == *" bench "* ]]; then
step "overhead, float32, batch 32"
check python3 benchmarks/tps_speed.py --part overhead --device cuda --batch-size 32 --rounds 3 \
    --runs 20 --warmup 5 --json-out "$OUT/overhead_fp32_b32.json"
step "overhead, bf16 autocast, batch 256"
check python3 benchmarks/tps_speed.py --part overhead --device cuda --amp bf16 --batch-size 256 \
    --rounds 3 --runs 20 --warmup 5 --json-out "$OUT/overhead_bf16_b256.json"
step "headline, float32 and bf16 autocast, batch 256"
check python3 benchmarks/tps_speed.py --part headline --device cuda --batch-size 256 --rounds 3 \
    --runs 20 --warmup 5 --json-out "$OUT/headline_fp32_b256.json"
check python3 benchmarks/tps_speed.py --part headline --device cuda --amp bf16 --batch-size 256 \
    --rounds 3 --runs 20 --warmup 5 --json-out "$OUT/headline_bf16_b256.json"
step "overhead of dtps under torch.compile (inductor), bf16 autocast, batch 256"
check timeout 150 python3 benchmarks/tps_speed.py --part overhead --variants dtps --no-base \
    --device cuda --amp bf16 --batch-size 256 --rounds 2 --runs 20 --warmup 3 --compile \
    --json-out "$OUT/overhead_dtps_bf16_b256_compile.json"
fi
if [[ " $PARTS " == *" sweep "* ]]; then
step "batch sweep: deit_tiny + dtps (keep 0.7, blocks 3,6,9) against deit_tiny, bf16 autocast"
check cli apply --model deit_tiny_patch16_224 --variant dtps --keep 0.7 --locs 3,6,9 \
    --no-throughput --out "$OUT/deit_t_dtps" --json
check cli bench --model "$OUT/deit_t_dtps" --device cuda --amp bf16 \
    --batch-sizes 1,8,32,128,256 --warmup 5 --runs 20 --bench-seconds 30 \
    --plot "$OUT/batch_sweep_deit_t_dtps_bf16.png" --json > "$OUT/batch_sweep_deit_t_dtps_bf16.json"
fi
if [[ " $PARTS " == *" windowed "* ]]; then
step "windowed: compressed Swin-T against Swin-T, keep 0.7, fp32, batch 64"
check timeout 300 python3 benchmarks/windowed_speed.py --device cuda --batch-size 64 --keeps 0.7 \
    --runs 20 --warmup 5 --json-out "$OUT/windowed_swin_t_b64.json"
fi
if [[ " $PARTS " == *" compiled "* ]]; then
# Issue 13: every model eager and compiled alike (fullgraph, COMPILE_MODE), interleaved in the
# same rounds: overhead vs the sliced-tokens model and the speed-up over the base, bf16, batch 256;
# then the headline dTPS-DeiT-S (2,4,6,8 / 0.5) vs DeiT-T the same way.
COMPILE_MODE=${COMPILE_MODE:-reduce-overhead}
COMPILE_VARIANTS=${COMPILE_VARIANTS:-dtps,etps,dynamicvit,evit}
step "overhead, bf16 autocast, batch 256, eager and compiled ($COMPILE_MODE)"
check timeout 420 python3 benchmarks/tps_speed.py --part overhead --device cuda --amp bf16 \
    --variants "$COMPILE_VARIANTS" \
    --batch-size 256 --rounds 2 --runs 20 --warmup 3 --compile --eager-too \
    --compile-mode "$COMPILE_MODE" --json-out "$OUT/overhead_bf16_b256_eager_and_compiled.json"
step "headline, bf16 autocast, batch 256, eager and compiled ($COMPILE_MODE)"
check timeout 240 python3 benchmarks/tps_speed.py --part headline --device cuda --amp bf16 \
    --batch-size 256 --rounds 2 --runs 20 --warmup 3 --compile --eager-too \
    --compile-mode "$COMPILE_MODE" --json-out "$OUT/headline_bf16_b256_eager_and_compiled.json"
fi
if [[ " $PARTS " == *" compiled-kernels "* ]]; then
# Issue 40: the kernels one compiled (inductor) forward of deit_small launches at batch 1, base
# and each method on its own ops, counted from the generated Triton code (on the CPU: 100-109 for
# the base, 106-212 compressed; docs/results-speed-cpu.md). Six compilations, JSON written after
# each, about 3 minutes.
step "compiled kernels: deit_small, batch 1, bf16 autocast, base and every method"
check timeout 300 python3 benchmarks/compiled_kernels.py --device cuda --bf16 \
    --json-out "$OUT/cuda_compiled_kernels_bf16.json"
fi
if [[ " $PARTS " == *" ladder"* ]]; then
# Issue 40: every method against its base and ideal slicing, in two fresh processes (medians),
# JSON records to $OUT/ladder-RUN.json and a table and plot ($OUT/ladder.md, .png) for the docs
# (copy the JSON to benchmarks/results/gpu/ and render it with benchmarks/gpu_ladder_report.py).
# The first process runs cells in priority order within LADDER_SECONDS (estimated per cell from
# its GMACs at the rate measured so far, plus compilation), the second the same cells within a
# fifth more: about 2.2 x LADDER_SECONDS plus two starts, under 6 minutes at the default 140.
# Run 7 (LADDER_SECONDS=110) spent its budget building and timing three models: the eager and
# graphed cells of each model now come side by side, and each part stops its processes at
# LADDER_DEADLINE seconds and still writes what they timed.
LADDER_RUN=${LADDER_RUN:-$(date +%Y%m%d-%H%M)}
LADDER_SECONDS=${LADDER_SECONDS:-140}
# Each part's processes stop at LADDER_DEADLINE (default 2.2 x the budget plus 40 s of starts)
# and the part itself 15 s later, so the JSON is always written.
LADDER_DEADLINE=${LADDER_DEADLINE:-$((LADDER_SECONDS * 22 / 10 + 40))}
LADDER_TIMEOUT=$((LADDER_DEADLINE + 15))
if [[ " $PARTS " == *" ladder "* ]]; then
    step "ladder $LADDER_RUN: 6 models, every method, bf16 and fp32, batches 1-256, eager and graphed"
    check timeout "$LADDER_TIMEOUT" python3 benchmarks/gpu_ladder.py --device cuda --run "$LADDER_RUN" \
        --modes eager,graphed --budget-seconds "$LADDER_SECONDS" \
        --deadline-seconds "$LADDER_DEADLINE" --json-out "$OUT/ladder-$LADDER_RUN.json"
fi
if [[ " $PARTS " == *" ladder-compiled "* ]]; then
    # Compiling every model of a cell (base, 5 methods, 5 ideal) took longer than 520 s in run 7:
    # its own lease. Each method is compiled and timed with the base and its ideal model alone,
    # and the deadline keeps the methods done.
    step "ladder $LADDER_RUN-compiled: deit_small and vit_base, bf16, batch 256 and 64, compiled"
    check timeout "$LADDER_TIMEOUT" python3 benchmarks/gpu_ladder.py --device cuda --run "$LADDER_RUN-compiled" \
        --models deit_small,vit_base --dtypes bf16 --batches 64,256 --modes compiled \
        --methods "${COMPILE_VARIANTS:-evit,dtps,etps,dynamicvit,tome}" \
        --budget-seconds "$LADDER_SECONDS" --deadline-seconds "$LADDER_DEADLINE" \
        --json-out "$OUT/ladder-$LADDER_RUN-compiled.json"
fi
if [[ " $PARTS " == *" ladder-multiple "* ]]; then
    # Issue 40 item 3: the eager ladder again with kept counts rounded to multiples of 8.
    step "ladder $LADDER_RUN-multiple8: the eager ladder with --kept-multiple 8"
    check timeout "$LADDER_TIMEOUT" python3 benchmarks/gpu_ladder.py --device cuda --run "$LADDER_RUN-multiple8" \
        --modes eager --kept-multiple 8 --budget-seconds "$LADDER_SECONDS" \
        --deadline-seconds "$LADDER_DEADLINE" --json-out "$OUT/ladder-$LADDER_RUN-multiple8.json"
fi
if [[ " $PARTS " == *" ladder-fused "* ]]; then
    # On CUDA the methods run their own ops by default; this times the Triton kernels instead.
    step "ladder $LADDER_RUN-fused: eager and graphed, bf16, with the fused kernels"
    check timeout "$LADDER_TIMEOUT" python3 benchmarks/gpu_ladder.py --device cuda --run "$LADDER_RUN-fused" \
        --models deit_tiny,deit_small,vit_base --dtypes bf16 --modes eager,graphed --fused \
        --methods dtps,etps,dynamicvit,tome --budget-seconds "$LADDER_SECONDS" \
        --deadline-seconds "$LADDER_DEADLINE" --json-out "$OUT/ladder-$LADDER_RUN-fused.json"
fi
for json in "$OUT"/ladder-"$LADDER_RUN"*.json; do
    [[ -f "$json" ]] && check python3 benchmarks/gpu_ladder_report.py "$json" \
        --doc "$OUT/ladder.md" --plot "${json%.json}.png"
done
fi
if [[ " $PARTS " == *" spread "* ]]; then
# Whether the bf16 headline's spread between processes is the host's launch rate: if so, eager
# DeiT-S + dTPS has a host share of 0.9 or more in every process and its speed alone moves
# (DeiT-S's does not), and at batch 1024 the ratio rises above 0.77 and moves far less.
for seed in 0 0 1 2; do
    step "headline, bf16 autocast, batch 256, seed $seed, a fresh process"
    check timeout 150 python3 benchmarks/tps_speed.py --part headline --device cuda --amp bf16 \
        --batch-size 256 --rounds 2 --runs 20 --warmup 5 --seed "$seed" \
        --json-out "$OUT/headline_bf16_b256_seed${seed}_$(date +%H%M%S).json"
done
step "headline, bf16 autocast, batch 1024"
check timeout 200 python3 benchmarks/tps_speed.py --part headline --device cuda --amp bf16 \
    --batch-size 1024 --rounds 2 --runs 10 --warmup 3 --seed 0 \
    --json-out "$OUT/headline_bf16_b1024.json"
fi
if [[ " $PARTS " == *" graphs "* ]]; then
# --cuda-graphs on CUDA: the capture's own tests, the command's path end to end, and the Swin-T
# cells run 8's earlier check refused (atomic adds differ between eager runs too).
step "CUDA graphs without a compiler: tests/test_cuda_graphs.py on CUDA"
gpu_tests tests/test_cuda_graphs.py
step "apply deit_small + dTPS, bf16 autocast, batch 8, --cuda-graphs"
check timeout 150 python3 -c "from vitcompress.cli.main import main; main()" apply \
    --model deit_small_patch16_224 --variant dtps --keep 0.7 --device cuda --amp bf16 \
    --batch-size 8 --cuda-graphs --bench-seconds 20 --out "$OUT/deit_s_dtps_graphs" --json \
    > "$OUT/apply_deit_s_dtps_cuda_graphs_b8.json"
step "Swin-T graphed, bf16, batches 64 and 256"
check timeout 200 python3 benchmarks/gpu_ladder.py --device cuda --run "${LADDER_RUN:-graphs}-swin" \
    --models swin_tiny --dtypes bf16 --batches 64,256 --modes graphed --budget-seconds 60 \
    --deadline-seconds 180 --json-out "$OUT/ladder-${LADDER_RUN:-graphs}-swin.json"
fi
if [[ " $PARTS " == *" kernels "* ]]; then
# The Triton kernels (the CUDA default for dTPS, eTPS and ToMe since run 8): equal to the method's
# ops when compiled (the interpreter tests cannot see compiled code), and faster than them.
step "Triton kernels compiled on CUDA against the method's ops"
gpu_tests tests/test_triton_cuda.py
step "kernel speed on CUDA: select_squeeze and tome_merge against the method's ops"
check timeout 90 python3 benchmarks/kernel_speed.py --device cuda --calls 200 \
    --json-out "$OUT/kernel_speed_select_cuda.json"
check timeout 90 python3 benchmarks/kernel_speed.py --device cuda --op tome --calls 200 \
    --json-out "$OUT/kernel_speed_tome_cuda.json"
# Their effect on whole models: PARTS=ladder-fused.
fi

step "done, status $status"
exit $status
