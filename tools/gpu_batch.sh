#!/usr/bin/env bash
# Several tools/gpu_session.sh stages in one GPU call, inside one time budget, each result packed into one
# file under OUT (a call brings back at most 8 files).
#   bash tools/gpu_batch.sh setup                    # fresh machine: join /opt/vb/part-*, install vLLM and .whl
#   bash tools/gpu_batch.sh run OUT JOB [JOB ...]    # after `. /opt/vb/env.sh`
# A JOB is NAME:STAGE[:VAR=VALUE,VAR=VALUE...], e.g. base:loop:STEPS=6 or glm:families:FAMS=glm4v; a value
# may hold spaces written as '+' (sl2:loop:STEPS=6,LOOP_ARGS=rollout.sleep_level=2). Each job runs
# `bash tools/gpu_session.sh STAGE /tmp/gpu_batch/NAME` with those variables and the time left (BUDGET_S from
# the start, default 570 s), then leaves OUT/NAME.tgz and prints the stage's last lines.
set -u
T0=$SECONDS
BUDGET_S=${BUDGET_S:-570}
case "${1:-}" in
setup)
  set -e
  [ -d .gpu/chunk-3 ] && cp .gpu/chunk-*/part-* /opt/vb/
  (cd /opt/vb && cat part-* | tar -x && bash install.sh)
  if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /opt/site .whl/*.whl; fi
  . /opt/vb/env.sh
  python3 -c "import omegaconf, mathruler, pylatexenc, compressed_tensors, loguru; print('vlrl packages ready')"
  echo "setup took $((SECONDS - T0)) s"
  ;;
run)
  OUT=$2; shift 2
  mkdir -p "$OUT"
  python3 -c "import torch; f, t = torch.cuda.mem_get_info(); print('device_gb %.2f %s' % (t / 2**30, torch.cuda.get_device_name()))" \
    | tee "$OUT/device.txt"
  for job in "$@"; do
    IFS=: read -r name stage vars <<< "$job"
    left=$(( BUDGET_S - (SECONDS - T0) ))
    if [ $left -lt 60 ]; then echo "== $name: skipped, ${left} s left"; continue; fi
    d=/tmp/gpu_batch/$name; rm -rf "$d"; mkdir -p "$d"
    envs=(LOOP_S=$((left - 25)) FAM_S=$((left - 25)) PROFILE_S=$((left - 25)) OPDIFF_S=$((left - 25)))
    IFS=, read -ra kvs <<< "${vars:-}"
    for kv in "${kvs[@]}"; do envs+=("${kv//+/ }"); done
    echo "== $name: $stage ${envs[*]} (${left} s left)"
    t=$SECONDS
    env "${envs[@]}" timeout $((left - 5)) bash tools/gpu_session.sh "$stage" "$d" > "$d/stage.out" 2>&1
    echo "== $name: rc=$? in $((SECONDS - t)) s"
    tail -40 "$d/stage.out"
    grep -h "  engine  \|training peak\|Traceback\|Error\|error:" "$d"/*.log 2>/dev/null | grep -v "^INFO" | head -8
    tar -czf "$OUT/$name.tgz" -C /tmp/gpu_batch "$name"
  done
  ;;
*)
  echo "usage: bash tools/gpu_batch.sh setup | run OUT NAME:STAGE[:VAR=VALUE,...] ..." >&2; exit 2
  ;;
esac
