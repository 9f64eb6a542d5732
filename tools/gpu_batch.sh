#!/usr/bin/env bash
# Several tools/gpu_session.sh stages in one GPU call, inside one time budget, each result packed into one
# file under OUT (a call brings back at most 8 files).
#   bash tools/gpu_batch.sh wheels                   # here: vlrl's packages the GPU image lacks, into .whl/
#   bash tools/gpu_batch.sh setup                    # fresh machine: join /opt/vb/part-*, install vLLM and .whl
#   bash tools/gpu_batch.sh run OUT JOB [JOB ...]    # after `. /opt/vb/env.sh`
#   bash tools/gpu_batch.sh caches OUT               # the machine's JIT caches into OUT, for the next session
# A JOB is NAME:STAGE[:VAR=VALUE,VAR=VALUE...], e.g. base:loop:STEPS=6 or glm:families:FAMS=glm4v; a value
# may hold spaces written as '+' (sl2:loop:STEPS=6,LOOP_ARGS=rollout.sleep_level=2), and ';' where the JOB is
# quoted as one shell word ('q35:qwen35:Q35_PARTS=update,Q35_UPDATE_SETS=-;model.liger_kernel=true'). Each job runs
# `bash tools/gpu_session.sh STAGE /tmp/gpu_batch/NAME` with those variables and the time left (BUDGET_S from
# the start, default 570 s), then leaves OUT/NAME.tgz and prints the stage's last lines.
#
# A session's calls, after `bash ../shared/gpu/build_vllm_bundle.sh` and `bash tools/gpu_batch.sh wheels` here and a
# snapshot of the last commit (`rm -rf .gpu/src && mkdir -p .gpu/src && git archive HEAD | tar -x -C .gpu/src`):
#   1. carry .gpu/chunk-1 .gpu/chunk-2:       mkdir -p /opt/vb && cp .gpu/chunk-1/part-1 .gpu/chunk-2/part-2 /opt/vb/
#      (a WITH_MOE=1 bundle has five chunks: carry chunk-3 and chunk-4 the same way in a second call)
#   2. carry .gpu/chunk-3 .whl .gpu/src:      bash .gpu/src/tools/gpu_batch.sh setup && . /opt/vb/env.sh && cd .gpu/src
#        && BUDGET_S=500 bash tools/gpu_batch.sh run $OUT base:loop:STEPS=6 sl2:loop:STEPS=6,LOOP_ARGS=rollout.sleep_level=2
#   3. carry .gpu/src:  . /opt/vb/env.sh && cd .gpu/src && bash tools/gpu_batch.sh run $OUT
#        compile:loop:STEPS=6,LOOP_ARGS=model.compile=true lora:loop:STEPS=6,LOOP_ARGS=model.lora.rank=16+model.lora.alpha=32
#   4. carry .gpu/src:  . /opt/vb/env.sh && cd .gpu/src && bash tools/gpu_batch.sh run $OUT glm:families:FAMS=glm4v,FAM_S=200
#        standalone:profile:PHASES=engine,PROFILE_S=200 opdiff:op_diff:OPDIFF_S=180
# JIT caches across sessions: a fresh machine spends minutes building Triton kernels (fla's Gated DeltaNet kernels
# took over 250 s on 2026-12-03) and compiling vLLM's graphs (~50 s at 3B). End a session's last call with
# `bash tools/gpu_batch.sh caches $OUT` (its pieces are up to five files, 50 MiB: keep the call's other files at
# three or fewer and small, or give it a call of its own; at 2026-12-03 16:30 the Triton cache held 302 MiB of
# files after the 3B and Qwen3.5 runs, 54 MiB as tar.gz, and vLLM's 58 MiB as tar.gz: both were left out, which
# is why it now packs with xz); copy what came back into .gpu/jit/ here, replacing the older pieces,
# and carry .gpu/jit in the call that runs `setup`, which joins the pieces and unpacks them where the kernels' and
# vLLM's caches look. A stale entry is only a miss: each
# cache keys its entries by source, versions and device.
set -u
T0=$SECONDS
BUDGET_S=${BUDGET_S:-570}
# Kill what still holds the GPU: a trainer that a timeout's SIGTERM left writing its checkpoint outlives torchrun
# (2026-12-03: one kept 78 GiB into the next call, whose run then ran out of memory). By PID from nvidia-smi: a
# pattern such as train.py would also match the shell that runs this call's command line
reap_gpu() {
  local pids
  pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | xargs)
  [ -z "$pids" ] && return 0
  echo "== $1: killing GPU processes left running: $pids"
  kill -9 $pids 2>/dev/null; sleep 3
}
case "${1:-}" in
wheels)
  # pure-Python packages setup.py needs that the GPU image (KINDS.md's list) lacks, vLLM's GLM-4.1V and
  # Qwen3.5 modules' compressed-tensors (which imports loguru), fla-core (Triton; einops) for Qwen3.5's
  # packed Gated DeltaNet in training, and liger-kernel (Triton) for model.liger_kernel; omegaconf 2.4 vendors its antlr4 runtime
  set -e
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  P=""; for n in 28 27 17; do P="$P --platform manylinux_2_${n}_x86_64"; done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $P \
    --platform manylinux2014_x86_64 -d .whl omegaconf==2.4.0 mathruler==0.1.0 pylatexenc==2.11 \
    compressed-tensors==0.20.0 loguru==0.7.3 fla-core==0.6.0 einops==0.8.2 liger-kernel==0.8.5
  # PyAV for video decoding (36 MB, an abi3 wheel): carry .whl in a call of its own if the tree is large
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $P \
    --platform manylinux2014_x86_64 -d .whl av==18.1.0
  ls .whl
  ;;
setup)
  set -e
  for part in .gpu/chunk-*/part-*; do [ -f "$part" ] && cp "$part" /opt/vb/; done  # the chunks this call carries
  (cd /opt/vb && cat part-* | tar -x && bash install.sh)
  if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /opt/site .whl/*.whl; fi
  for first in .gpu/jit/jit-*.part-aa; do  # an earlier session's JIT caches (see `caches`), where carried
    [ -f "$first" ] || continue
    case "$first" in
      *.txz.part-aa) cat "${first%aa}"* | xz -dc | tar -x -C / ;;
      *) cat "${first%aa}"* | tar -xz -C / ;;
    esac && echo "unpacked $(basename "${first%.part-aa}")"
  done
  . /opt/vb/env.sh
  python3 -c "import omegaconf, mathruler, pylatexenc, compressed_tensors, loguru, fla.ops; print('vlrl packages ready')"
  echo "setup took $((SECONDS - T0)) s"
  ;;
run)
  OUT=$2; shift 2
  mkdir -p "$OUT"
  # Triton keeps autotuning results in its cache (with the kernels `caches` brings back): fla asks for that itself,
  # vLLM's own copy of fla's Gated DeltaNet kernels does not (a fresh machine's first Qwen3.5 run autotuned 22
  # kernels for 213 s on 2026-12-03, vLLM's 8 of them for 54 s in generation)
  export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
  python3 -c "import torch; f, t = torch.cuda.mem_get_info(); print('device_gb %.2f %s' % (t / 2**30, torch.cuda.get_device_name()))" \
    | tee "$OUT/device.txt"
  # the host too: machines of one GPU kind differ by up to 2x in generation at the same GPU clocks
  echo "host $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores, $(grep -m1 'cpu MHz' /proc/cpuinfo | cut -d: -f2 | xargs) MHz" \
    | tee -a "$OUT/device.txt"
  for job in "$@"; do
    IFS=: read -r name stage vars <<< "$job"
    left=$(( BUDGET_S - (SECONDS - T0) ))
    if [ $left -lt 60 ]; then echo "== $name: skipped, ${left} s left"; continue; fi
    d=/tmp/gpu_batch/$name; rm -rf "$d"; mkdir -p "$d"
    envs=(LOOP_S=$((left - 25)) FAM_S=$((left - 25)) PROFILE_S=$((left - 25)) OPDIFF_S=$((left - 25)))
    IFS=, read -ra kvs <<< "${vars:-}"
    for kv in "${kvs[@]}"; do envs+=("${kv//+/ }"); done
    echo "== $name: $stage ${envs[*]} (${left} s left)"
    reap_gpu "before $name"
    t=$SECONDS
    env "${envs[@]}" timeout $((left - 5)) bash tools/gpu_session.sh "$stage" "$d" > "$d/stage.out" 2>&1
    echo "== $name: rc=$? in $((SECONDS - t)) s"
    tail -40 "$d/stage.out"
    grep -h "  engine  \|training peak\|Traceback\|Error\|error:" "$d"/*.log 2>/dev/null | grep -v "^INFO" | head -8
    tar -czf "$OUT/$name.tgz" -C /tmp/gpu_batch "$name"
  done
  reap_gpu "after the last job"
  ;;
caches)
  # Triton's kernel cache, vLLM's compile cache and inductor's, each as one tar.xz (absolute paths inside, for
  # `setup`; xz, multi-threaded: the Triton cache of 2026-12-03, 302 MiB of files, is 43 MiB as tar.gz and 18 MiB
  # as tar.xz) cut into 15 MiB pieces, within JIT_FILES files (default 5) and JIT_MIB MiB (default 50) in all: a
  # call brings back 8 files of 16 MiB, and the call that carries them back with .gpu/src, .whl and chunk-5 takes
  # 64 MiB. A cache that would pass what is left is left out
  OUT=$2; mkdir -p "$OUT"
  room=$(( ${JIT_MIB:-50} << 20 )); files=${JIT_FILES:-5}
  for entry in triton:${TRITON_CACHE_DIR:-$HOME/.triton/cache} vllm:${VLLM_CACHE_ROOT:-$HOME/.cache/vllm} \
      inductor:${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_$(whoami)}; do
    name=${entry%%:*}; dir=${entry#*:}
    [ -d "$dir" ] || { echo "jit-$name: no $dir"; continue; }
    ext=txz; command -v xz > /dev/null || ext=tgz  # gzip where the image has no xz (setup reads either)
    if [ $ext = txz ]; then tar -cf - -C / "${dir#/}" | xz -T0 -6 > "/tmp/jit-$name.$ext"
    else tar -czf "/tmp/jit-$name.$ext" -C / "${dir#/}"; fi
    size=$(stat -c %s "/tmp/jit-$name.$ext"); pieces=$(( (size + (15 << 20) - 1) / (15 << 20) ))
    if [ "$size" -gt "$room" ] || [ "$pieces" -gt "$files" ]; then
      echo "jit-$name: $((size >> 20)) MiB from $dir in $pieces pieces, more than is left to bring back: left out"
    else
      split -b 15m -a 2 "/tmp/jit-$name.$ext" "$OUT/jit-$name.$ext.part-"
      room=$((room - size)); files=$((files - pieces))
      echo "jit-$name: $((size >> 10)) KiB from $dir in $pieces piece(s)"
    fi
    rm -f "/tmp/jit-$name.$ext"
  done
  ;;
*)
  echo "usage: bash tools/gpu_batch.sh wheels | setup | run OUT NAME:STAGE[:VAR=VALUE,...] ... | caches OUT" >&2; exit 2
  ;;
esac
