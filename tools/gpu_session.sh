#!/usr/bin/env bash
# The GPU measurements behind docs/benchmarks.md, one stage per call of a GPU session.
#   bash tools/gpu_session.sh STAGE OUTDIR
# Stages (each fits in a 10-minute call on one or two H200s, after `. /opt/vb/env.sh` for vLLM):
#   tiny      tools/gpu_check.sh on the tiny Qwen2.5-VL, then the one-GPU tests of tests/gpu
#   tp        the vLLM tensor-parallel pair alone (two GPUs; every rank's stack after HANG_S=100 s, which
#             a cold machine needs: engine construction compiles kernels for ~60 s;
#             RUNNERS="default 0" tries vLLM's model runner choice, then the V1 runner;
#             TP_ASYNC_SCHEDULING=0 turns vLLM's async scheduling off)
#   trained   vLLM and the torch engine vs the policy on a trained checkpoint (TRAINED=model dir,
#             TRAINED_DATA=its eval parquet; e.g. a merged `make demo` run)
#   train     build the 3B-shaped model; training throughput with sdpa and with varlen attention
#   full      the whole benchmark suite on the 3B-shaped model (ATTN=varlen|sdpa, default varlen)
#   fidelity  vLLM vs policy logprobs on the 3B-shaped model (SHARPEN=1, then SHARPEN=40 in a second call)
#   scale     3B-shaped GRPO steps on one GPU, then on two (NPROCS="1 2"; policy sharded, one engine per GPU)
#   loop      train.py with the 3B recipe on one GPU (STEPS=8; LOOP_ARGS for overrides); tools/loop_summary.py
#   loopab    `loop` here and in OLD (another commit's tree), alternating (AB="new old new")
#   profile   bench.py's update at the loop's shape under torch.profiler (and one step's phases without it: --phase-clock),
#             and in-process vs standalone vLLM
#   multi     two GPUs: GRPO steps with the policy sharded over both, vLLM TP=2 and TP=1 (TPS="2 1")
#   families  vLLM vs policy logprobs on tiny models of the families in VLLM_UNVERIFIED (FAMS, default
#             "idefics3 gemma3 llava"; then e.g. FAMS="qwen2_vl qwen3_vl qwen2_5_vl" in a second call;
#             up to FAM_S=150 s each; DTYPE=float32 for a second pass without bf16 rounding)
#   moe       Qwen3.5-MoE: the tiny model's vLLM logprob check (MOE_CHECK=0 skips it), then train.py steps with
#             routing replay off and on (up to STEP_S=300 s each)
#   video     vLLM vs policy logprobs on video prompts (tiny Qwen2.5-VL and Qwen3-VL, FAMS; FPS=4), the
#             video prompt check, tests/gpu/test_vllm_video.py (carry the PyAV wheel in .gpu/avwhl)
#   turns     tools/bench_turns.py on the 3B shape: 3-turn episodes against single-turn generation with a
#             per-turn breakdown; zoom crops (the same per prompt, then distinct per episode, then without
#             image keys: --mm-uuids 0), then text tool messages (TURNS_RUNS="NAME:ARGS ..." for others)
#   qwen35    Qwen3.5-4B's shapes (random weights, make_tiny_model --size qwen3_5_4b): fla's packed Gated
#             DeltaNet forward and backward against the torch rule (tests/gpu/test_qwen3_5_packing.py, up to
#             Q35_TEST_S=180 s; prints the device's route past fla's #640 guard and the self-check's errors),
#             then the tiny Qwen3.5's varlen attention against sdpa (tests/gpu/test_varlen_attention.py -k qwen3_5,
#             up to Q35_TEST_S); the update alone (bench.py, 128 sequences x 256 tokens), each variant of
#             Q35_UPDATE_SETS (";"-separated sets of space-separated config overrides, "-" for none; default "-")
#             in turn, up to Q35_UPDATE_S=240 s each, the first profiled (q35_profile.txt), one line each; and
#             train.py GRPO steps at 16 prompts x 8 x 256; Q35_PARTS="test update loop" (the default) picks parts
#   tests     TESTS (default tests/gpu/test_device_peak.py) under pytest, up to TEST_S=120 s
#   onedevice parallel.one_device on the GPU, no vLLM: its CPU-built tests on CUDA (tests/test_gathered_passes.py,
#             tests/test_one_device.py: bitwise against FSDP with the GPU's kernels), the update alone in FSDP
#             units and as a plain module, alternating (ONE_SETS, each side named; MAX_TOKENS, default the
#             recipe's 8192; ONE_ARGS, overrides for both, e.g. model.activation_checkpointing=true to fit a 78 GiB
#             card), then tools/host_cost.py's ref and train parts (the 3B depths at width 256: the host's cost
#             with CUDA)
#   levers    the update's host-side levers, no vLLM (~7 min): the GPU tests of model.flash_direct and
#             model.torch_rms_norm (LEVER_TESTS=0 skips them), one call of RMSNorm, SwiGLU and rotary by
#             implementation (tools/norm_cost.py at the 3B update's shapes; LEVER_COST=0 skips it), then the update
#             alone for each of LEVER_SETS (as UPDATE_SETS; default: as shipped, the two host levers off, as shipped
#             with model.liger_mlp=false, then as shipped again), UPDATE_STEPS (default 5) timed steps each, the
#             first set profiled
#   op_diff   tools/op_diff.py with the vLLM engine on the tiny Qwen2.5-VL (DTYPE, default bfloat16; OPDIFF_ARGS);
#             OPDIFF_3B=1: on the 3B shape at 448x448 with --exact (OPDIFF_EXACT=0 without), op_diff_3b.json
#   exact     rollout.exact on the tiny Qwen2.5-VL with 128-wide heads (tiny_hd128): tests/gpu/test_exact.py (256
#             sequences, exact and not, bitwise
#             check and cost, exact_tiny.json), then op_diff --exact (op_diff_exact.json), then two-turn episodes
#             with a zoom tool (tests/gpu/test_exact_episodes.py, exact_episodes.json); ~6 min. EXACT_3B=1: the
#             same test on the 3B shape at 448x448 instead (exact_3b.json; a call of its own)
#             EXACT_EPISODE_SIZES="tiny tiny_hd128": the two-turn check alone for those sizes (exact_episodes_SIZE.json)
#             EXACT_VARIANTS="SIZE[@SIDE] ..." (or "default": tiny_hd128 at 56 and 448, the tiny_hd128_* sizes, each with one
#             feature of the 3B shape, at 448x448): the kernel probes at the 3B shapes (op_diff --kernels,
#             exact_kernels.json; EXACT_KERNELS=0 skips them, EXACT_KERNELS=1 alone runs only them), then the exact
#             run alone on each (exact_SIZE_SIDE.json), printing max |dlogprob| for each; EXACT_BUDGET_S=560
set -u
STAGE=$1
OUT=${2:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
PY=${PY:-python3}
W=/tmp/vlrl_bench
M=$W/model_3b

# The random-weight Qwen2.5-VL at the 3b size in $M (bfloat16, on the GPU), unless a stage built it already.
build_3b() {
  [ -f $M/config.json ] || $PY tools/make_tiny_model.py --family qwen2_5_vl --size 3b --out $M --device cuda \
    --dtype bfloat16 --overwrite > "$OUT/build_3b.log" 2>&1
}

# train.py with configs/clevr_qwen2_5_vl_3b.yaml as shipped apart from paths, at the benchmark's shape
# (16 prompts x 8 responses x 256 new tokens, 448x448 images) on one GPU: recipe_loop MODEL NAME LABEL STEPS.
# No eval and no checkpoint at the end (together 2.5 min of a 6-min call on the 3B shape).
recipe_loop() {
  local model=$1 name=$2 label=$3 steps=$4
  $PY tools/make_dataset.py --kind clevr --n 256 --seed 3 --out $W/loop.parquet --size 448x448 > /dev/null
  rm -rf $W/$name
  # -k 5: SIGTERM makes the trainer write a checkpoint before it exits (minutes at 3B); KILL 5 s later
  timeout -k 5 ${LOOP_S:-400} $PY -m torch.distributed.run --standalone --nproc-per-node 1 train.py \
    --config configs/clevr_qwen2_5_vl_3b.yaml model.path=$model data.train_path=$W/loop.parquet \
    data.eval_path= trainer.run_dir=$W/$name trainer.max_steps=$steps trainer.eval_every=0 \
    data.prompts_per_step=16 rollout.max_new_tokens=256 checkpoint.every_steps=0 checkpoint.at_end=false \
    trainer.progress=false \
    ${LOOP_ARGS:-} > "$OUT/$name.log" 2>&1
  echo "$label GRPO loop rc=$?"
  cp $W/$name/metrics.jsonl "$OUT/${name}_metrics.jsonl" 2>/dev/null
  cp $W/$name/config.yaml "$OUT/${name}_config.yaml" 2>/dev/null
  for f in $W/$name/profile_step_*.txt; do [ -f "$f" ] && cp "$f" "$OUT/${name}_$(basename "$f")"; done  # trainer.profile_step
  $PY tools/loop_summary.py "$OUT/${name}_metrics.jsonl" --config "$OUT/${name}_config.yaml" | tee "$OUT/${name}_summary.json"
  # the steady steps' clocks and host per phase in one line (trainer.gpu_telemetry), where they were logged
  $PY -c "import json, sys; s = json.load(open(sys.argv[1])); print('telemetry (max %s MHz): ' % s.get('sm_clock_max_mhz') + '; '.join(
    '%s clock %.0f/%.0f MHz throttled %.2f (power %.2f, thermal %.2f) busy %.0f%% memory %.0f%% cores here %.2f '
    '(main thread %.2f) elsewhere %.2f' % ((p,) + tuple(s.get(k + '_' + p, float('nan')) for k in ('sm_clock_mhz_mean',
    'sm_clock_mhz_min', 'throttled_frac', 'power_capped_frac', 'thermal_frac', 'util_pct_mean', 'mem_util_pct_mean',
    'process_cores', 'main_thread_cores', 'other_cores')))
    for p in ('gen', 'logprob', 'train')))" "$OUT/${name}_summary.json" 2>/dev/null
}
# A standalone vLLM on a recipe_loop's requests (16 prompts x 8 responses x the run's new tokens, 448x448
# images), then the loop's summary again with its generation against it (loop_gen_vs_standalone):
# standalone_vs_loop NAME BENCH_MODEL_ARGS... (files $OUT/NAME_standalone.*). The length is the run's
# rollout.max_new_tokens (LOOP_ARGS may change it), read from its resolved config.
standalone_vs_loop() {
  local name=$1 gen_tokens
  shift
  gen_tokens=$($PY -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['rollout']['max_new_tokens'])" \
    "$OUT/${name}_config.yaml" 2>/dev/null || echo 256)
  # STANDALONE_INPROC=1: a second standalone run with vLLM's engine core in-process, as in the trainer (~1.5 min
  # more; STANDALONE_S then defaults to 360 s)
  local limit=${STANDALONE_S:-240}
  [ "${STANDALONE_INPROC:-0}" = 1 ] && limit=${STANDALONE_S:-360}
  timeout $limit $PY tools/bench.py "$@" --phases engine --group 8 --gen-prompts 16 \
    --gen-tokens $gen_tokens --image-size 448 $([ "${STANDALONE_INPROC:-0}" = 1 ] && echo --standalone-inproc) \
    --json-out "$OUT/${name}_standalone.json" > "$OUT/${name}_standalone.log" 2>&1
  echo "standalone vLLM rc=$?"
  $PY tools/loop_summary.py "$OUT/${name}_metrics.jsonl" --config "$OUT/${name}_config.yaml" \
    --standalone "$OUT/${name}_standalone.json" | tee "$OUT/${name}_summary.json" | grep standalone
}
# One line from a bench.py --phases train JSON: update_summary FILE
update_summary() {
  $PY -c "import json;d=json.load(open('$1'));print('step_s=%.3f mfu_llm=%.4f peak=%.1f attn=%s liger=%s busy=%s%% main_thread_cores=%.2f device_allocs=%.0f' % (d['train_step_s'], d['mfu_llm'], d['peak_mem_gb_train'], d['attn_implementation'], d['liger_kernel'], '%.0f' % d['util_pct_mean_train'] if 'util_pct_mean_train' in d else '-', d.get('main_thread_cores_train', float('nan')), d.get('device_allocs_per_step', float('nan'))) + ('' if 'profiled_idle_s' not in d else ' profiled: block %.2f s, kernels busy %.2f s, idle %.2f s' % (d['profiled_block_s'], d['profiled_busy_s'], d['profiled_idle_s'])))" 2>&1 | tail -1
}
# The phases of a bench.py --phase-clock step in one line (host s / device span s each): clock_summary FILE
clock_summary() {
  $PY -c "import json, sys; d = json.load(open(sys.argv[1])); c = d.get('phase_clock') or {}; print('  phases, host/device s (one step of %.3f s, no profiler): ' % d.get('phase_clock_step_s', 0) + '; '.join('%s %dx %.3f/%s' % (k, v['count'], v['host_s'], '-' if v['device_s'] is None else '%.3f' % v['device_s']) for k, v in c.items()))" "$1" 2>/dev/null
}
# The update alone (bench.py --phases train: 128 sequences x 256 tokens, 448x448 images, 3 timed steps) once per
# set of overrides in SETS (";"-separated sets of space-separated config overrides, "-" for none; a word that
# starts with -- is a bench.py flag, e.g. --empty-cache), the first set profiled unless UPDATE_PROFILE=0, one line each and one of the phases without the profiler (--phase-clock): update_sets PREFIX SETS TIMEOUT_S LABEL BENCH_ARGS... (files $OUT/PREFIXupdate_<n>.*)
update_sets() {
  local prefix=$1 sets=$2 limit=$3 label=$4 n=0 v kv args prof variants
  shift 4
  IFS=";" read -ra variants <<< "$sets"
  for v in "${variants[@]}"; do
    # a word of a set that starts with -- is bench.py's own flag (--empty-cache), any other a config override
    args=""; [ "$v" != "-" ] && for kv in $v; do [[ $kv == --* ]] && args="$args $kv" || args="$args --set $kv"; done
    prof=""; [ $n = 0 ] && [ "${UPDATE_PROFILE:-1}" = 1 ] && prof="--profile $OUT/${prefix}profile.txt"
    timeout $limit $PY tools/bench.py --phases train --train-seqs 128 --group 8 --response-len 256 --image-size 448 \
      --train-steps ${UPDATE_STEPS:-3} --phase-clock "$@" $args $prof --json-out "$OUT/${prefix}update_$n.json" \
      > "$OUT/${prefix}update_$n.log" 2>&1
    echo "$label [$v] rc=$? $(update_summary "$OUT/${prefix}update_$n.json")"
    clock_summary "$OUT/${prefix}update_$n.json"
    n=$((n+1))
  done
}
case "$STAGE" in
tiny)
  bash tools/gpu_check.sh "$OUT/check"
  timeout 300 $PY -m pytest -q -s tests/gpu -k "not tensor_parallel" > "$OUT/pytest_gpu.log" 2>&1
  echo "pytest gpu rc=$?" >> "$OUT/check/summary.txt"
  tail -5 "$OUT/pytest_gpu.log"
  ;;
tp)
  $PY tools/make_tiny_model.py --family qwen2_5_vl --size tiny --out $W/tiny --overwrite > /dev/null
  # RUNNERS: vLLM model runners to try in turn ("" = vLLM's choice, 0 = V1, 1 = V2); stop at the first pass
  for r in ${RUNNERS:-default}; do
    [ "$r" = default ] && unset VLLM_USE_V2_MODEL_RUNNER || export VLLM_USE_V2_MODEL_RUNNER=$r
    NCCL_DEBUG=${NCCL_DEBUG:-WARN} timeout $(( ${HANG_S:-100} + 60 )) $PY -m torch.distributed.run --standalone \
      --nproc-per-node 2 tests/gpu/test_vllm_engine.py $W/tiny ${HANG_S:-100} > "$OUT/tp_pair_$r.log" 2>&1
    rc=$?; echo "tensor-parallel pair, model runner $r: rc=$rc"
    [ $rc = 0 ] && break
  done
  ;;
trained)
  for e in vllm torch; do
    timeout 200 $PY tools/logprob_check.py --model "$TRAINED" --data "$TRAINED_DATA" --task clevr --engine $e \
      --num-prompts 32 --n 8 --max-new-tokens 12 --max-pixels 12544 --out "$OUT/trained_$e.json" \
      > "$OUT/trained_$e.log" 2>&1; echo "trained $e rc=$?"
  done
  ;;
train)
  for attn in sdpa varlen; do
    timeout 280 $PY tools/bench.py --size 3b --phases train --train-steps 2 --attn "$attn" --json-out "$OUT/train_$attn.json" ${BENCH_ARGS:-} \
      > "$OUT/train_$attn.log" 2>&1; echo "train $attn rc=$?"
  done
  ;;
full)
  timeout 560 $PY tools/bench.py --size 3b --attn "${ATTN:-varlen}" --json-out "$OUT/bench.json" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"
  ;;
fidelity)
  build_3b
  $PY tools/make_dataset.py --kind clevr --n 64 --seed 3 --out $W/fid.parquet --size 448x448 > /dev/null
  for s in ${SHARPEN:-1}; do  # one value per call fits: a fresh process compiles vLLM first (~1 min)
    timeout 280 $PY tools/logprob_check.py --model $M --data $W/fid.parquet --engine vllm --num-prompts 16 --n 4 \
      --max-new-tokens 128 --min-pixels 200704 --max-pixels 200704 --sharpen "$s" --out "$OUT/fid_3b_$s.json" \
      > "$OUT/fid_3b_$s.log" 2>&1; echo "fidelity sharpen=$s rc=$?"
  done
  ;;
scale)
  # GRPO steps of the 3B-shaped model on 1 GPU, then with the policy sharded over 2 (one engine each)
  build_3b
  $PY tools/make_dataset.py --kind clevr --n 64 --seed 3 --out $W/fid.parquet --size 448x448 > /dev/null
  for np in ${NPROCS:-1 2}; do
    timeout ${SCALE_S:-240} $PY -m torch.distributed.run --standalone --nproc-per-node $np train.py \
      --config configs/clevr_qwen2_5_vl_3b.yaml model.path=$M data.train_path=$W/fid.parquet \
      data.eval_path=$W/fid.parquet trainer.run_dir=$W/scale_$np trainer.max_steps=${STEPS:-3} trainer.eval_every=0 \
      data.prompts_per_step=16 rollout.max_new_tokens=256 rollout.engine=vllm model.activation_checkpointing=false \
      optim.max_tokens_per_microbatch=8192 checkpoint.every_steps=0 > "$OUT/scale_$np.log" 2>&1
    echo "3B GRPO on $np GPU(s) rc=$?"
    cp $W/scale_$np/metrics.jsonl "$OUT/scale_${np}_metrics.jsonl" 2>/dev/null
  done
  ;;
loop)
  # The user's path: train.py with configs/clevr_qwen2_5_vl_3b.yaml as shipped apart from paths, at the
  # benchmark's shape (16 prompts x 8 responses x 256 new tokens, 448x448 images), STEPS steps on one GPU;
  # STANDALONE=1 then times a standalone vLLM on the same requests (~2 min more; STANDALONE_INPROC=1 also with
  # vLLM's engine core in-process, as in the trainer).
  build_3b
  recipe_loop $M loop "3B" ${STEPS:-8}
  if [ "${STANDALONE:-0}" = 1 ]; then standalone_vs_loop loop --size 3b; fi
  ;;
loopab)
  # `loop` in this tree and in OLD (another commit's snapshot on the same machine, e.g. `git archive 34e2252`
  # copied to /opt/old by an earlier call), in the order of AB (default "new old new"), STEPS (5) steps each,
  # one line each (tools/loop_summary.py's last line): what a host-side change does to the loop, on one machine.
  here=$PWD; n=0
  for which in ${AB:-new old new}; do
    dir=$here; [ "$which" = old ] && dir=${OLD:?OLD: the other tree}
    (cd "$dir" && STEPS=${STEPS:-5} bash tools/gpu_session.sh loop "$OUT/${n}_$which") > "$OUT/${n}_$which.log" 2>&1
    echo "$n $which rc=$?: $(tail -1 "$OUT/${n}_$which.log" | cut -c1-300)"
    n=$((n+1))
  done
  ;;
profile)
  # The update alone at the loop's shape, profiled (op tables), and the engine in-process against a
  # standalone vLLM on the same requests (16 prompts x 8 responses x 256 new tokens).
  timeout ${PROFILE_S:-540} $PY tools/bench.py --size 3b --phases ${PHASES:-train,engine} --train-seqs 128 --group 8 --phase-clock \
    --response-len 256 --max-tokens 8192 --gen-prompts 16 --gen-tokens 256 --image-size 448 --train-steps 2 \
    --profile "$OUT/profile.txt" --json-out "$OUT/bench.json" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  echo "profile rc=$?"; grep -v "^INFO\|^WARNING\|^\[" "$OUT/bench.log" | tail -5
  ;;
update)
  # The update alone at the loop's shape, each variant of UPDATE_SETS (";"-separated config overrides,
  # "-" for none) in turn, the first one profiled.
  update_sets "" "${UPDATE_SETS:--;model.compile=true;optim.unsharded_accumulation=false}" 240 update \
    --size 3b --max-tokens 8192
  ;;
multi)
  $PY tools/make_tiny_model.py --family qwen2_5_vl --size tiny --out $W/tiny --overwrite > /dev/null
  $PY tools/make_dataset.py --kind clevr --n 96 --seed 0 --out $W/c56.parquet --size 56x56 > /dev/null
  for tp in ${TPS:-2 1}; do
    timeout 200 $PY -m torch.distributed.run --standalone --nproc-per-node 2 train.py --config configs/demo.yaml \
      model.path=$W/tiny data.train_path=$W/c56.parquet data.eval_path=$W/c56.parquet trainer.run_dir=$W/multi_tp$tp \
      trainer.max_steps=3 rollout.engine=vllm rollout.tensor_parallel_size=$tp trainer.eval_every=0 \
      trainer.eval_samples=16 data.min_pixels=3136 data.max_pixels=3136 rollout.gpu_memory_utilization=0.3 \
      checkpoint.every_steps=0 > "$OUT/multi_tp$tp.log" 2>&1; echo "2 GPUs, vLLM TP=$tp rc=$?"
    cp $W/multi_tp$tp/metrics.jsonl "$OUT/multi_tp${tp}_metrics.jsonl" 2>/dev/null
  done
  ;;
families)
  # vLLM 0.26's LLaVA module imports mistral_common (a dependency of vllm the slim bundle leaves out):
  # carry its wheels in .whl (ignored by git): mistral_common, jsonschema, jsonschema-specifications,
  # referencing, rpds-py, pydantic-extra-types, tiktoken (pip download --no-deps --only-binary=:all:
  # --python-version 3.12 ...). The names transformers 5.17 removed are vllm_engine.vllm_compat's.
  if [ -d .whl ]; then $PY -m pip install -q --no-index --no-deps --no-compile --target /opt/site .whl/*.whl; fi
  # 56x56 images suit every tiny processor (LLaVA and Gemma3: the tower's square; Qwen: within its
  # pixel limits); SmolVLM gets 84x56 so its images split into a 1x2 tile grid plus the global tile.
  # DTYPE: auto (bf16 on a GPU) or float32 (separates implementation differences from rounding).
  d=${DTYPE:-auto}
  for f in ${FAMS:-idefics3 gemma3 llava}; do
    size=56x56; [ "$f" = idefics3 ] && size=84x56
    extra=""
    # Gemma4: non-square, so its aspect-keeping resize (to 160x96: 60 soft tokens, longer than the
    # 16-token window) and the padded patch sequence (240 of 280 patches) are exercised; the policy on
    # sdpa, which takes the image-block masks its sliding layers need (flash_attention_2 would not).
    [ "$f" = gemma4 ] && size=84x56 && extra="--set model.attn_implementation=sdpa"
    # vLLM 0.26 runs Gemma4's two head sizes on FlashAttention 4, which needs the CUTLASS DSL (nvidia-cutlass-dsl,
    # in a full vLLM install, not in the slim bundle): without it, vLLM's Triton attention
    if [ "$f" = gemma4 ] && ! $PY -c "import cutlass" 2>/dev/null; then
      extra="$extra --set rollout.attention_backend=TRITON_ATTN"; echo "families gemma4: no CUTLASS DSL, TRITON_ATTN"
    fi
    $PY tools/make_tiny_model.py --family $f --size tiny --out $W/fam_$f --overwrite > /dev/null  # a few s; never stale
    $PY tools/make_dataset.py --kind clevr --n 32 --seed 0 --out $W/fam_$f.parquet --size $size > /dev/null
    timeout ${FAM_S:-150} $PY tools/logprob_check.py --model $W/fam_$f --data $W/fam_$f.parquet --task clevr --engine vllm \
      --num-prompts 16 --n 4 --max-new-tokens 32 --min-pixels 3136 --max-pixels 12544 --dtype $d $extra ${FAM_ARGS:-} \
      --out "$OUT/fam_${f}_$d.json" > "$OUT/fam_${f}_$d.log" 2>&1
    rc=$?; echo "families $f $d rc=$rc"
    [ $rc = 0 ] || grep -v "^INFO\|^\[rank" "$OUT/fam_${f}_$d.log" | tail -6
  done
  ;;
moe)
  # Qwen3.5-MoE on vLLM (needs the bundle built with WITH_MOE=1): the tiny model's logprob check, then
  # GRPO steps through train.py with algorithm.routing_replay off and on (RRS), fidelity metrics per step.
  # MOE_CHECK=0 skips the logprob check (~4.5 min on a fresh machine, most of it Triton compiling kernels).
  # The train.py runs take MOE_ARGS (default rollout.enforce_eager=true: no vLLM compile or CUDA graphs, whose
  # start-up left a 155 s budget without a first step on a fresh machine).
  [ "${MOE_CHECK:-1}" = 1 ] && FAMS=qwen3_5_moe bash tools/gpu_session.sh families "$OUT"
  $PY tools/make_tiny_model.py --family qwen3_5_moe --size tiny --out $W/moe --overwrite > "$OUT/moe_build.log" 2>&1
  $PY tools/make_dataset.py --kind clevr --n 128 --seed 0 --out $W/moe.parquet --size 56x56 > /dev/null
  for rr in ${RRS:-false true}; do
    rm -rf $W/moe_run_$rr
    # a fresh machine's first engine start took over 140 s (Triton compiling the MoE and Gated DeltaNet kernels)
    timeout ${STEP_S:-300} $PY -m torch.distributed.run --standalone --nproc-per-node 1 train.py --config configs/demo.yaml \
      model.path=$W/moe data.train_path=$W/moe.parquet data.eval_path= trainer.run_dir=$W/moe_run_$rr \
      trainer.max_steps=${STEPS:-4} trainer.eval_every=0 rollout.engine=vllm algorithm.routing_replay=$rr \
      trainer.progress=false rollout.max_new_tokens=32 ${MOE_ARGS:-rollout.enforce_eager=true} > "$OUT/moe_run_$rr.log" 2>&1
    echo "routing_replay=$rr rc=$?"
    cp $W/moe_run_$rr/metrics.jsonl "$OUT/moe_metrics_$rr.jsonl" 2>/dev/null
    grep -ho '"fidelity/token_mult_prob_error": [0-9.]*' "$OUT/moe_metrics_$rr.jsonl" 2>/dev/null | tr '\n' ' '; echo
  done
  ;;
video)
  # Video prompts through vLLM on the tiny Qwen2.5-VL and Qwen3-VL (FAMS): generated clips
  # (make_dataset --kind video, FPS frames per second) through tools/logprob_check.py --engine vllm, then
  # vLLM's processor against the trainer's prompt ids, pixels and timing (tools/vllm_prompt_check.py),
  # then tests/gpu/test_vllm_video.py. PyAV comes from .whl (gpu_batch.sh setup); .gpu/avwhl/ is a fallback.
  # The engines run eager (no torch.compile or CUDA-graph capture at start-up): about 300 s in all; the
  # timeouts (FAM_S, PROMPT_S, TEST_S, each per family) keep a hung part within one 10-minute call.
  $PY -c "import av" 2>/dev/null || for w in .gpu/avwhl/*.whl; do
    [ -f "$w" ] && $PY -m pip install -q --no-index --no-deps --no-compile --target /opt/site "$w"; done
  d=${DTYPE:-auto}
  for f in ${FAMS:-qwen2_5_vl qwen3_vl}; do
    $PY tools/make_tiny_model.py --family $f --size tiny --out $W/vid_$f --overwrite > /dev/null
    $PY tools/make_dataset.py --kind video --n 16 --seed 0 --out $W/vid_$f.parquet --fps ${FPS:-4} --frames 8 \
      --size 64x64 > /dev/null
    timeout ${FAM_S:-110} $PY tools/logprob_check.py --model $W/vid_$f --data $W/vid_$f.parquet --task video \
      --engine vllm --num-prompts 8 --n 4 --max-new-tokens 32 --min-pixels 3136 --max-pixels 12544 --dtype $d \
      --set rollout.enforce_eager=true --out "$OUT/video_${f}_$d.json" > "$OUT/video_${f}_$d.log" 2>&1
    rc=$?; echo "video $f $d rc=$rc $(tail -c 400 "$OUT/video_${f}_$d.json" 2>/dev/null)"
    [ $rc = 0 ] || grep -v "^INFO\|^\[rank" "$OUT/video_${f}_$d.log" | tail -6
    timeout ${PROMPT_S:-80} $PY tools/vllm_prompt_check.py --family $f --model $W/vid_$f \
      > "$OUT/video_prompt_$f.jsonl" 2> "$OUT/video_prompt_$f.log"
    rc=$?; echo "video prompt check $f rc=$rc $(grep -c '"ok": true' "$OUT/video_prompt_$f.jsonl") checks ok"
    grep '"ok": false' "$OUT/video_prompt_$f.jsonl" | cut -c1-400
  done
  for f in ${FAMS:-qwen2_5_vl qwen3_vl}; do  # one vLLM engine per process, as the other GPU tests have it
    timeout ${TEST_S:-100} $PY -m pytest -q -s tests/gpu/test_vllm_video.py -k $f > "$OUT/pytest_video_$f.log" 2>&1
    rc=$?; echo "pytest video $f rc=$rc"
    grep "token_mult_prob_error\|passed\|failed\|Error" "$OUT/pytest_video_$f.log" | tail -6
  done
  ;;
turns)
  build_3b
  # TURNS_RUNS: space-separated NAME:ARGS, '@' for a space inside ARGS (gpu_batch.sh turns '+' into the spaces
  # between runs), one bench_turns.py process each, up to TURNS_S=170 s each (~100 s on a warm machine: the
  # engine's build is most of it); each prints its summary line (per turn: vLLM's request adding vs engine
  # steps, images sent/processed/encoded, prefill tokens) and leaves turns_NAME.json. For example
  # TURNS_RUNS=prof:--crops@same@--profile-turns@1 also profiles the single-turn call, turn 1 and the last
  # turn (CUDA kernels and CPU ops per call in turns_prof.json; @--trace-dir@DIR adds chrome traces in DIR);
  # var:--lengths@varied and cont:--lengths@varied@--continuous@1 compare turn-by-turn with continuous turns
  for run in ${TURNS_RUNS:-zoom:--crops@same zoom_distinct:--crops@distinct zoom_nokeys:--mm-uuids@0 text:--text-tools}; do
    name=${run%%:*}; args=${run#*:}
    timeout ${TURNS_S:-170} $PY tools/bench_turns.py --model $M ${args//@/ } --json-out "$OUT/turns_$name.json" \
      > "$OUT/turns_$name.log" 2>&1
    echo "turns $name rc=$? $($PY tools/bench_turns.py --summarize "$OUT/turns_$name.json" 2>/dev/null)"
  done
  ;;
qwen35)
  # Q35_PARTS picks parts (default "test update loop"): on a fresh machine each builds fla's Triton kernels,
  # so the three together may not fit one call (the test alone took over 250 s there, 25 s once built);
  # Q35_MAX_TOKENS: the update's and the loop's micro-batch (default 4096)
  parts=" ${Q35_PARTS:-test update loop} "
  if [[ $parts == *" test "* ]]; then
    timeout ${Q35_TEST_S:-180} $PY -m pytest -q -s tests/gpu/test_qwen3_5_packing.py > "$OUT/q35_packing.log" 2>&1
    echo "qwen3.5 packed delta rule (fla vs torch) rc=$? $(tail -1 "$OUT/q35_packing.log")"
    grep -h "route\|guard lifted" "$OUT/q35_packing.log" | cut -c1-400
    # the full-attention layers (gated output, partial m-rope) through the varlen kernel against sdpa
    timeout ${Q35_TEST_S:-180} $PY -m pytest -q -s tests/gpu/test_varlen_attention.py -k qwen3_5 \
      > "$OUT/q35_varlen.log" 2>&1
    echo "qwen3.5 varlen attention (varlen vs sdpa) rc=$? $(tail -1 "$OUT/q35_varlen.log")"
    grep -h "varlen vs" "$OUT/q35_varlen.log" | cut -c1-400
  fi
  Q=$W/model_qwen3_5_qwen3_5_4b
  [ -f $Q/config.json ] || $PY tools/make_tiny_model.py --family qwen3_5 --size qwen3_5_4b --out $Q --device cuda \
    --dtype bfloat16 --overwrite > "$OUT/build_q35.log" 2>&1
  if [[ $parts == *" update "* ]]; then
    # as the update stage: each variant of Q35_UPDATE_SETS in turn, e.g. "-;model.attn_implementation=varlen"
    update_sets q35_ "${Q35_UPDATE_SETS:--}" ${Q35_UPDATE_S:-240} "qwen3.5-4b update" \
      --family qwen3_5 --size qwen3_5_4b --max-tokens ${Q35_MAX_TOKENS:-4096}
  fi
  # the recipe's 8192-token micro-batches ran out of memory in Qwen3.5-4B's update on a 139.8 GiB H200 (its Gated
  # DeltaNet layers keep far wider activations than attention layers, and it shares no prompts)
  if [[ $parts == *" loop "* ]]; then
    LOOP_ARGS="optim.max_tokens_per_microbatch=${Q35_MAX_TOKENS:-4096} ${LOOP_ARGS:-}" \
      recipe_loop $Q q35_loop "qwen3.5-4b" ${STEPS:-4}
    if [ "${STANDALONE:-0}" = 1 ]; then standalone_vs_loop q35_loop --family qwen3_5 --size qwen3_5_4b; fi
  fi
  ;;
levers)
  if [ "${LEVER_TESTS:-1}" = 1 ]; then
    timeout ${TEST_S:-150} $PY -m pytest -q -s tests/gpu/test_flash_direct.py tests/gpu/test_vision_once.py \
      > "$OUT/levers_tests.log" 2>&1
    echo "tests rc=$?"; grep -E "max \||passed|failed" "$OUT/levers_tests.log" | tail -8
  fi
  if [ "${LEVER_COST:-1}" = 1 ]; then
    for op in "rms_norm" "rms_norm --rows 16384 --width 1280" "swiglu --width 11008" \
              "swiglu --rows 16384 --width 3456" "rope"; do
      timeout 90 $PY tools/norm_cost.py --op $op --json-out "$OUT/cost_${op%% *}_$RANDOM.json" 2>&1 | grep "^${op%% *} "
    done
  fi
  off="model.torch_rms_norm=false model.flash_direct=false"
  UPDATE_STEPS=${UPDATE_STEPS:-5} update_sets lever_ \
    "${LEVER_SETS:--;$off;model.liger_mlp=false;-}" 240 update --size 3b --max-tokens 8192
  ;;
tests)
  # a few GPU tests on their own (TESTS, default the memory metric's check against mem_get_info)
  timeout ${TEST_S:-120} $PY -m pytest -q -s ${TESTS:-tests/gpu/test_device_peak.py} > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; tail -3 "$OUT/tests.log"
  ;;
onedevice)
  timeout ${TEST_S:-240} $PY -m pytest -q -x -p no:cacheprovider tests/test_gathered_passes.py tests/test_one_device.py \
    > "$OUT/one_device_tests.log" 2>&1
  echo "one-device tests rc=$?"; tail -2 "$OUT/one_device_tests.log"
  # each side named: "-" (no override) is whatever the default is now
  one_sets="parallel.one_device=fsdp;parallel.one_device=plain;parallel.one_device=fsdp"
  sets=""; IFS=";" read -ra ones <<< "${ONE_SETS:-$one_sets}"
  for v in "${ones[@]}"; do [ "$v" = - ] && v=""; sets="$sets;${ONE_ARGS:-} $v"; done
  UPDATE_PROFILE=0 update_sets "" "${sets#;}" ${ONE_UPDATE_S:-200} update --size 3b --max-tokens ${MAX_TOKENS:-8192}
  timeout ${HOST_COST_S:-100} $PY tools/host_cost.py --parts ref,train > "$OUT/host_cost.json" 2> "$OUT/host_cost.err"
  echo "host_cost rc=$?"; cat "$OUT/host_cost.json"
  ;;
op_diff)
  if [ "${OPDIFF_3B:-0}" = 1 ]; then
    # the 3B shape at 448x448 (1024 patches, 16 vision windows), exact mode unless OPDIFF_EXACT=0: the first module
    # that is not bitwise, vision tower included (each sequence runs alone through the engine: one image per
    # encoder call, one prefill); ~1 min to draw the model on a fresh machine, then ~3 min
    build_3b
    $PY tools/make_dataset.py --kind clevr --n 32 --seed 3 --out $W/opd3b.parquet --size 448x448 > /dev/null
    timeout ${OPDIFF_S:-400} $PY tools/op_diff.py --model $M --data $W/opd3b.parquet --task clevr --engine vllm \
      --dtype bfloat16 --min-pixels 200704 --max-pixels 200704 --num-prompts ${OPDIFF_PROMPTS:-2} --n 2 \
      --max-new-tokens 16 $([ "${OPDIFF_EXACT:-1}" = 1 ] && echo --exact) ${OPDIFF_ARGS:-} \
      --out "$OUT/op_diff_3b.json" > "$OUT/op_diff_3b.log" 2>&1
    echo "op_diff 3b rc=$?"
    # the modules that are not bitwise, in forward order (the first is the culprit), then the verdict lines
    grep -E "^model\.|^lm_head|^logprobs" "$OUT/op_diff_3b.log" | grep -E " no( |$)" | head -12
    grep "first module\|engine generation\|exact mode\|Error" "$OUT/op_diff_3b.log" | cut -c1-600 | tail -4
  else
    $PY tools/make_tiny_model.py --family qwen2_5_vl --size tiny --out $W/tiny --overwrite > /dev/null
    $PY tools/make_dataset.py --kind clevr --n 32 --seed 0 --out $W/opd.parquet --size 56x56 > /dev/null
    timeout ${OPDIFF_S:-240} $PY tools/op_diff.py --model $W/tiny --data $W/opd.parquet --task clevr --engine vllm \
      --dtype ${DTYPE:-bfloat16} ${OPDIFF_ARGS:-} --out "$OUT/op_diff.json" > "$OUT/op_diff.log" 2>&1
    echo "op_diff rc=$?"; grep -v "^INFO\|^WARNING\|^\[" "$OUT/op_diff.log" | tail -30
  fi
  ;;
exact)
  if [ "${EXACT_3B:-0}" = 1 ]; then
    build_3b
    $PY tools/make_dataset.py --kind clevr --n 64 --seed 3 --out $W/exact3b.parquet --size 448x448 > /dev/null
    EXACT_MODEL=$M EXACT_DATA=$W/exact3b.parquet EXACT_MIN_PIXELS=200704 EXACT_MAX_PIXELS=200704 \
      EXACT_ARGS="${EXACT_ARGS:---set model.activation_checkpointing=true}" \
      EXACT_OUT="$OUT/exact_3b.json" EXACT_S=${EXACT_S:-280} timeout 580 $PY -m pytest -q -s tests/gpu/test_exact.py \
      > "$OUT/exact_3b.log" 2>&1
    echo "exact 3b rc=$?"; grep '"cost_pct"\|passed\|failed\|Error' "$OUT/exact_3b.log" | tail -4
  elif [ -n "${EXACT_VARIANTS:-}" ] || [ "${EXACT_KERNELS:-0}" = 1 ]; then
    # bisecting a mismatch: the kernel probes at the 3B shapes (op_diff --kernels: cuBLAS row invariance,
    # FlashAttention decode = prefill; ~1 min), then the exact run alone on each SIZE[@SIDE] (a make_tiny_model size,
    # SIDExSIDE images, default 448), one process each, while EXACT_BUDGET_S lasts (~1-1.5 min each)
    [ "${EXACT_VARIANTS:-}" = default ] && EXACT_VARIANTS="tiny_hd128@56 tiny_hd128 tiny_hd128_vit3b \
tiny_hd128_gqa8 tiny_hd128_mlp tiny_hd128_vocab tiny_hd128_deep"
    if [ "${EXACT_KERNELS:-1}" = 1 ]; then
      timeout ${EXACT_KERNELS_S:-150} $PY tools/op_diff.py --kernels --out "$OUT/exact_kernels.json" \
        > "$OUT/exact_kernels.log" 2>&1
      echo "kernel probes rc=$?"
      grep "^kernel probes\|^  attention\|NOT bitwise\|vs cuBLAS\|Error" "$OUT/exact_kernels.log" | head -44
    fi
    per=${EXACT_VARIANT_S:-150}
    for v in ${EXACT_VARIANTS:-}; do
      size=${v%@*}; side=448; [ "$size" != "$v" ] && side=${v#*@}
      left=$(( ${EXACT_BUDGET_S:-560} - SECONDS ))
      if [ $left -lt $per ]; then echo "exact $size@$side: skipped, $left s left"; continue; fi
      f="$OUT/exact_${size}_$side"
      EXACT_SIZE=$size EXACT_PX=$side EXACT_ONLY=${EXACT_ONLY:-1} EXACT_OUT="$f.json" EXACT_S=$per \
        timeout $(( per + 20 )) $PY -m pytest -q -s tests/gpu/test_exact.py -k reports_its_cost \
        > "$f.log" 2>&1
      rc=$?
      $PY - "$f.json" "$size@$side" $rc <<'PYEOF'
import json, sys
path, name, rc = sys.argv[1:]
try:
    s = json.load(open(path))["summary"]
except (OSError, ValueError, KeyError):
    sys.exit(print(f"exact {name}: rc={rc}, no report (see its .log)"))
e = s["exact"]
print(f"exact {name}: rc={rc} max |dlogprob| {e['max_abs_dlogprob']:.3e}, mult-prob error median "
      f"{e['token_mult_prob_error_median']:.7f} max {e['token_mult_prob_error_max']:.7f} over {s['tokens']} tokens; "
      f"worst tokens at positions {s['worst_positions_exact']}")
PYEOF
    done
  elif [ -n "${EXACT_EPISODE_SIZES:-}" ]; then
    # the two-turn check alone, each size in a process of its own (where the mismatches sit; a one-turn control)
    for s in $EXACT_EPISODE_SIZES; do
      timeout ${EXACT_TURNS_S:-240} $PY -m tests.gpu.test_exact_episodes "$OUT/exact_episodes_$s.json" $W/ep_$s $s \
        > "$OUT/exact_episodes_$s.log" 2>&1
      echo "exact episodes $s rc=$?"; head -c 1500 "$OUT/exact_episodes_$s.json" 2>/dev/null; echo
    done
  else
    # what the installed vLLM's batch-invariant mode replaces and accepts (docs/fidelity.md, "Exact mode")
    $PY - > "$OUT/vllm_batch_invariant.txt" 2>&1 <<'PYEOF'
import inspect, vllm
import vllm.model_executor.layers.batch_invariant as bi
print("vllm", vllm.__version__)
for name in ("enable_batch_invariant_mode", "override_envs_for_invariance", "init_batch_invariance"):
    f = getattr(bi, name, None)
    print(f"--- {name}{inspect.signature(f) if f else ' (absent)'}")
    if f:
        print("\n".join(l for l in inspect.getsource(f).splitlines() if "impl(" in l or "Backend" in l or "environ" in l))
PYEOF
    echo "vLLM batch-invariant facts: $(head -1 "$OUT/vllm_batch_invariant.txt")"
    EXACT_OUT="$OUT/exact_tiny.json" EXACT_S=${EXACT_S:-150} timeout 330 $PY -m pytest -q -s tests/gpu/test_exact.py \
      > "$OUT/exact_tiny.log" 2>&1
    echo "exact tiny rc=$?"; grep '"cost_pct"\|passed\|failed\|Error' "$OUT/exact_tiny.log" | tail -4
    # 128-wide heads: exact mode refuses narrower ones on an H200 (rollout.exact.check_head_size)
    $PY tools/make_tiny_model.py --family qwen2_5_vl --size tiny_hd128 --out $W/tiny_hd128 --overwrite > /dev/null
    $PY tools/make_dataset.py --kind clevr --n 32 --seed 0 --out $W/opd.parquet --size 56x56 > /dev/null
    timeout ${OPDIFF_S:-200} $PY tools/op_diff.py --model $W/tiny_hd128 --data $W/opd.parquet --task clevr --engine vllm \
      --dtype bfloat16 --exact --out "$OUT/op_diff_exact.json" > "$OUT/op_diff_exact.log" 2>&1
    echo "op_diff --exact rc=$?"; grep "first module\|exact mode" "$OUT/op_diff_exact.log" | tail -3
    # two-turn episodes with a zoom tool's image: vLLM's second-turn logprobs against the packed episode
    EXACT_OUT="$OUT/exact_episodes.json" timeout ${EXACT_TURNS_S:-240} $PY -m pytest -q -s tests/gpu/test_exact_episodes.py \
      > "$OUT/exact_episodes.log" 2>&1
    echo "exact episodes rc=$?"; grep 'max_abs_dlogprob\|passed\|failed\|Error' "$OUT/exact_episodes.log" | tail -3
  fi
  ;;
*)
  echo "unknown stage $STAGE" >&2; exit 2
  ;;
esac
