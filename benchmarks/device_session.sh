#!/usr/bin/env bash
# One batched accelerator session (the lent H200): install, accelerator tests, conformance, benchmarks.
# Usage (on the device machine, repo root): bash benchmarks/device_session.sh [tests|demo|bench|bench-parts|multi|real-llama|real-wan|real-r0|real-gaps|real-remeasure|real-check|two-gpus|load|first-step|cap-grid|generate|split-cost|plan-probe|executor-list|all|none]
# (none: install only, for commands run after it with PYTHONPATH=/tmp/magi-site;
#  MAGI_SESSION_INSTALLED=1: use the install already in /tmp/magi-site, e.g. while a bench started from it runs)
# Results and logs go to $OUT (or ./device-out when OUT is unset). The device tool brings back at most 8 files, so
# each mode writes few (tests: 4 logs and env.txt; JUnit XML only with MAGI_SESSION_JUNIT=1).
set -uo pipefail
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
what=${1:-all}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
site=/tmp/magi-site
# always a fresh install: a warm machine keeps /tmp between calls, and stale magi code there would be tested
if [ "${MAGI_SESSION_INSTALLED:-0}" != 1 ]; then
rm -rf "$site"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
  && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$site" \
     . ./backends/cuda ./backends/musa || { echo "install failed"; exit 3; }
fi
export PYTHONPATH=$site:${PYTHONPATH:-}
{ df -h /dev/shm; nproc; free -g; uname -r; cat /sys/kernel/mm/transparent_hugepage/shmem_enabled; } | tee "$OUT/env.txt"
junit() { [ "${MAGI_SESSION_JUNIT:-0}" = 1 ] && echo "--junitxml=$OUT/$1.xml"; }
python3 - <<'PY' | tee -a "$OUT/env.txt"
import torch, magi_core, platform
print("torch", torch.__version__, "python", platform.python_version())
print("devices", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
b = magi_core.get_backend(); print("backend", b.name, b.device_type, b.version)
PY
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m magi_core backends --json > "$OUT/backends.json" 2>&1 || rc=1
  python3 -m pytest -p magi --pyargs magi_core.testing.conformance --magi-backend=cuda -q -rs \
    $(junit conformance) 2>&1 | tee "$OUT/conformance.log" || rc=1
  python3 -m pytest -q -rs -m "accelerator" tests backends/cuda/tests -p no:cacheprovider --durations=20 \
    $(junit accel) 2>&1 | tee "$OUT/accel.log" || rc=1
  # the executor suites that run on whichever backend is active: here on CUDA (real streams, caching allocator)
  python3 -m pytest -q -rs tests/execute/test_executor.py tests/compile/test_threads.py \
    tests/execute/test_weight_updates.py tests/compile/test_handle.py tests/plan/test_schedulers.py \
    tests/execute/test_transfer.py tests/api/test_offload_api.py -p no:cacheprovider \
    $(junit executor-cuda) 2>&1 | tail -n 15 \
    | tee "$OUT/executor-cuda.log" || rc=1
fi
if [ "$what" = demo ] || [ "$what" = all ]; then
  python3 -m magi_core demo --no-progress 2>&1 | tee "$OUT/demo.log" || rc=1
fi
if [ "$what" = multi ] || [ "$what" = all ]; then
  python3 benchmarks/host_bandwidth.py --out "$OUT/host_bandwidth_h200.json" 2>&1 | tee "$OUT/host_bandwidth.log" || rc=1
  if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/host_bandwidth.py \
      --out "$OUT/host_bandwidth_2xh200.json" 2>&1 | tee "$OUT/host_bandwidth_2x.log" || rc=1
  fi
fi
if [ "$what" = bench-parts ]; then
  # the full grid in parts on two GPUs of one host (one part alone outlasts a 10-minute device call), merged
  day=$(date -u +%F)
  ( CUDA_VISIBLE_DEVICES=0 python3 -m magi_core bench --models mlp --grid full --time-budget 0 \
      --out "$OUT/part-mlp.json" > "$OUT/part-mlp.log" 2>&1
    CUDA_VISIBLE_DEVICES=0 python3 -m magi_core bench --models transformer --tokens 2048 --grid full --time-budget 0 \
      --out "$OUT/part-tf2048.json" > "$OUT/part-tf2048.log" 2>&1 ) &
  CUDA_VISIBLE_DEVICES=1 python3 -m magi_core bench --models transformer --tokens 16384 --grid full --time-budget 0 \
    --systems resident_eager,resident_compiled,magi,diffusers --out "$OUT/part-tf16384.json" > "$OUT/part-tf16384.log" 2>&1
  wait
  python3 benchmarks/report.py --merge "$OUT/$day-merged.json" "$OUT"/part-*.json --md "$OUT/BENCHMARKS.md" \
    > "$OUT/merge.log" 2>&1 || rc=1
fi
# the real-model grid of the performance issue, in parts that each fit one 10-minute device call (carry the
# diffusers wheel in .whl for wan14b); merge the parts with benchmarks/report.py --merge
if [ "$what" = real-llama ]; then
  python3 -m magi_core bench --models llama8b --tokens 8192,16384 --grid full --ratios 0,0.5 --budgets 0.5 \
    --systems resident_compiled,magi --no-overhead-probe --time-budget "${SESSION_BENCH_BUDGET:-380}" \
    --out "$OUT/part-llama8b-8192-16384.json" 2>&1 | tail -n 40 || rc=1
fi
if [ "$what" = real-wan ]; then
  python3 -m magi_core bench --models wan14b --tokens 2184,16380 --grid full --ratios 0,0.5,1 --budgets 0.5 \
    --time-budget "${SESSION_BENCH_BUDGET:-480}" --out "$OUT/part-wan14b-2184-16380.json" 2>&1 | tail -n 40 || rc=1
fi
if [ "$what" = real-r0 ]; then  # ratio 0 where the rotary-table fix and the shared copy buffer show
  python3 -m magi_core bench --models wan14b --tokens 2184,16380 --policies HEURISTIC --ratios 0 --budgets "" \
    --systems resident_compiled,magi --no-overhead-probe --time-budget "${SESSION_BENCH_BUDGET:-300}" \
    --out "$OUT/part-wan14b-r0.json" 2>&1 | tail -n 12 || rc=1
fi
if [ "$what" = real-gaps ]; then  # the grid's runs cut by earlier time budgets
  python3 -m magi_core bench --models llama8b --tokens 8192,16384 --policies BASE --grid full --ratios 0,0.5 --budgets 0.5 \
    --systems magi --no-overhead-probe --time-budget "${SESSION_BENCH_BUDGET:-250}" \
    --out "$OUT/part-llama8b-base.json" 2>&1 | tail -n 12 || rc=1
  python3 -m magi_core bench --models wan14b --tokens 2184,16380 --policies COST_EFFECTIVE,BASE --grid full --ratios 0,0.5 \
    --budgets 0.5 --systems magi,accelerate --no-overhead-probe --time-budget "${SESSION_BENCH_BUDGET:-250}" \
    --out "$OUT/part-wan14b-base-ce.json" 2>&1 | tail -n 12 || rc=1
fi
if [ "$what" = real-remeasure ]; then  # session 8's fixes: ratio-0 peaks (shared buffer), budgets (fit), BASE r0.5
  remeasure() { name=$1; shift; python3 -m magi_core bench --grid full --systems magi --no-overhead-probe \
      --out "$OUT/part-$name.json" "$@" 2>&1 | tail -n 6 || rc=1; }
  remeasure llama8b-budgets --models llama8b --tokens 8192,16384 --policies HEURISTIC,COST_EFFECTIVE,BASE \
    --ratios "" --budgets 0.5 --time-budget "${SESSION_BENCH_BUDGET:-140}"
  remeasure llama8b-base-r05 --models llama8b --tokens 8192,16384 --policies BASE --ratios 0.5 --budgets "" \
    --time-budget 60
  remeasure llama8b-h-r0 --models llama8b --tokens 8192,16384 --policies HEURISTIC --ratios 0 --budgets "" \
    --time-budget 60
  remeasure wan14b-h-r0 --models wan14b --tokens 2184,16380 --policies HEURISTIC --ratios 0 --budgets "" \
    --time-budget 60
  remeasure wan14b-8190-h-budget --models wan14b --tokens 8190 --policies HEURISTIC --ratios "" --budgets 0.5 \
    --time-budget 40
fi
if [ "$what" = real-check ]; then  # wan14b 16380 ratio 0 next to its resident step, one process, one GPU
  python3 -m magi_core bench --models wan14b --tokens 16380 --policies HEURISTIC --ratios 0 --budgets "" \
    --systems resident_compiled,magi --grid full --no-overhead-probe --time-budget 0 \
    --out "$OUT/part-wan14b-16380-r0-check.json" 2>&1 | tail -n 6 || rc=1
fi
if [ "$what" = two-gpus ]; then  # the two-rank runs of issues 16 and 18 (nvidia-h200-x2)
  python3 -m pytest -q -rs -m accelerator tests/host/test_host_accelerator.py -p no:cacheprovider 2>&1 | tail -n 15 \
    | tee "$OUT/host-accel.log" || rc=1
  MAGI_PIN_CONCURRENCY=2 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/llama70b_two_gpus.py \
    --out "$OUT/llama70b-2xh200.json" > "$OUT/llama70b.log" 2>&1 || rc=1
  python3 benchmarks/moe_ep.py --nproc 2 --backend nccl --dtype bfloat16 --unit-compiler eager --ep 1 2 \
    --vocab 32000 --hidden 4096 --intermediate 14336 --layers 2 --heads 32 --kv-heads 8 --experts 8 --top-k 2 \
    --batch 1 --seq 256 --timeout 300 --out "$OUT/moe-ep-2xh200.json" > "$OUT/moe.log" 2>&1 || rc=1
fi
if [ "$what" = load ]; then  # an 8B-class checkpoint on local disk: load rate against the page cache
  ck=${SESSION_CKPT_DIR:-/tmp/magi-ckpt}/load-rate
  rm -rf "$ck"  # a run killed while writing it leaves an index naming files that are not there
  python3 benchmarks/load_rate.py --layers 32 --hidden 4096 --ffn 14336 --vocab 128256 --repeats 3 --pin \
    --also-threads "${MAGI_LOAD_THREADS:-1,4}" \
    --dir "$ck" --out "$OUT/load-rate-8b.json" 2>&1 | tail -n 5 || rc=1
  rm -rf "$ck"
fi
if [ "$what" = first-step ]; then  # time to the first offloaded step against diffusers and accelerate
  ck=${SESSION_CKPT_DIR:-/tmp/magi-ckpt}/wan14b
  rm -rf "$ck"
  python3 benchmarks/first_step_vs_peers.py --model wan14b --dir "$ck" --out "$OUT/first-step-wan14b.json" \
    --worker-timeout "${MAGI_WORKER_TIMEOUT:-300}" 2>&1 | tail -n 8 || rc=1
  rm -rf "$ck"
fi
if [ "$what" = cap-grid ]; then  # step time against card size (benchmarks/cap_grid.py), one process per row, resumable:
  # each call runs rows for SESSION_CAP_BUDGET seconds and writes $OUT/cap-grid-h200.json (and the plot); copy that file
  # over the newest benchmarks/results/*cap-grid-h200.json (or name one in SESSION_CAP_RESUME) before the next call,
  # which resumes from it, until it reports 0 remaining. SESSION_CAP_MODELS / SESSION_CAP_CAPS / SESSION_CAP_SYSTEMS
  # narrow it (comma lists); SESSION_CAP_RERUN (comma list of row-key patterns, e.g. '*/magi_default') runs rows again
  # that the resumed result has (after a change to what they measure).
  prev=${SESSION_CAP_RESUME:-$(ls benchmarks/results/*cap-grid-h200.json 2>/dev/null | tail -n 1)}
  resume=(); [ -f "$prev" ] && resume=(--resume "$prev")
  python3 benchmarks/cap_grid.py --models "${SESSION_CAP_MODELS:-llama8b,wan14b,flux}" \
    --caps "${SESSION_CAP_CAPS:-12GiB,16GiB,24GiB,48GiB,none}" \
    --systems "${SESSION_CAP_SYSTEMS:-magi_default,magi_r0,diffusers,accelerate}" \
    --time-budget "${SESSION_CAP_BUDGET:-450}" ${resume[@]+"${resume[@]}"} ${SESSION_CAP_RERUN:+--rerun "$SESSION_CAP_RERUN"} \
    --out "$OUT/cap-grid-h200.json" \
    --plot "$OUT/cap-grid-h200.png" > "$OUT/cap-grid.log" 2>&1 || rc=1
  tail -n 30 "$OUT/cap-grid.log"
fi
if [ "$what" = split-cost ]; then  # what the unit split itself costs, apart from streaming: per model the compiled
  # resident step, magi-core at ratio 1 compiled whole (one unit), at ratio 1 split into blocks (max_unit_bytes set:
  # every unit resident, nothing streamed) and the default config on the whole card; SESSION_SPLIT_MODELS narrows it
  for m in ${SESSION_SPLIT_MODELS:-flux llama8b}; do
    case $m in flux) t=4096;; wan14b) t=2184;; *) t=2048;; esac  # the cap grid's token counts, one per model
    python3 -m magi_core bench --models "$m" --tokens "$t" --systems resident_compiled,magi --magi-default --policies HEURISTIC \
      --ratios 1 --budgets "" --no-overhead-probe --no-host-timing --steps 5 --time-budget 0 \
      --out "$OUT/split-cost-$m-whole.json" > "$OUT/split-cost-$m-whole.log" 2>&1 || rc=1
    MAGI_OFFLOAD_MAX_UNIT_BYTES=256MiB python3 -m magi_core bench --models "$m" --tokens "$t" --systems magi --policies HEURISTIC \
      --ratios 1 --budgets "" --no-overhead-probe --no-host-timing --steps 5 --time-budget 0 \
      --out "$OUT/split-cost-$m-split.json" > "$OUT/split-cost-$m-split.log" 2>&1 || rc=1
    tail -n 6 "$OUT/split-cost-$m-whole.log" "$OUT/split-cost-$m-split.log"
  done
fi
if [ "$what" = plan-probe ]; then  # why the default config runs slower than its ideal at some card sizes (issue 32):
  # each case (model, tokens, cap or -, variants) a process of its own (the cap applies from the first allocation):
  # plan, copy and compute gaps, and the host's own time per step (host_ms). The default case puts the whole model
  # compiled resident, the default plan (trimmed), the untrimmed plan (every unit resident, one unit per block) and
  # the whole graph as one unit (ratio 1) side by side: what unit boundaries cost, and whether the step waits for
  # the host. Other variants: HEURISTIC-notrim#2GiB (units of several blocks); another case e.g. "flux 4096 24GiB
  # HEURISTIC,HEURISTIC-nospread" in SESSION_PLAN_PROBES, one case per line; SESSION_PLAN_STEPS timed steps per
  # variant (default 20), interleaved in rounds (every variant alive at once; SESSION_PLAN_INTERLEAVE=0: one after
  # another, for cases too large to hold together). Each variant's profiled step is kept as a Chrome trace under
  # traces-<case>/, and its synchronizing calls are listed in the JSON (host_syncs)
  while read -r m tokens cap variants; do
    [ -n "$m" ] || continue
    [ "$cap" = - ] && cap=
    python3 benchmarks/plan_probe.py --model "$m" --tokens "$tokens" --ratio default ${cap:+--device-memory "$cap"} \
      --variants "$variants" --steps "${SESSION_PLAN_STEPS:-20}" --profiles \
      $([ "${SESSION_PLAN_INTERLEAVE:-1}" = 1 ] && echo --interleave) --trace "$OUT/traces-$m-${cap:-whole}" \
      --out "$OUT/plan-probe-$m-${cap:-whole}.json" > "$OUT/plan-probe-$m-${cap:-whole}.log" 2>&1 || rc=1
  done <<< "${SESSION_PLAN_PROBES:-wan14b 2184 - resident,HEURISTIC,HEURISTIC-notrim,HEURISTIC@1}"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 -m magi_core bench --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" || rc=1
fi
if [ "$what" = executor-list ]; then  # the executor-facing suites on CUDA, one line per test (a run cut short by its
  # time limit still names every result so far): the tests that count compiles or device bytes alone first, then the
  # whole list in the order of SESSION_EXECUTOR_LIST
  python3 -m pytest -v -rf -p no:cacheprovider \
    "tests/compile/test_device_fit.py::test_ratio_one_second_input_shape_on_a_card_that_holds_the_model_once" \
    "tests/compile/test_generate.py::test_greedy_generate_with_a_kv_cache_matches_eager" \
    tests/compile/test_generate.py::test_inductor_units_serve_every_length_of_a_growing_cache \
    > "$OUT/executor-alone.log" 2>&1 || rc=1
  python3 -m pytest -v -rf -p no:cacheprovider ${SESSION_EXECUTOR_LIST:-tests/execute/test_executor.py \
    tests/compile/test_device_fit.py tests/compile/test_generate.py tests/execute/test_weight_updates.py tests/execute/test_step_host_work.py \
    tests/compile/test_threads.py tests/compile/test_handle.py tests/api/test_offload_api.py tests/plan/test_spread.py} \
    > "$OUT/executor-list.log" 2>&1 || rc=1
  grep -E "PASSED|FAILED|ERROR|SKIPPED" "$OUT/executor-list.log" | grep -vc PASSED
fi
if [ "$what" = generate ]; then  # issue 34 item 3: llama8b generate (magi bench --generate), one process per system,
  # one JSON: the compiled resident model, magi-core HEURISTIC at ratio 0, half the weights and ratio 0.9, accelerate
  # device_map with half the weights offloaded to the host (its timed generate at most SESSION_GEN_ACCEL_S seconds); no
  # system starts after SESSION_GEN_BUDGET seconds (each process may take what is left), so one 10-minute call holds it
  python3 -m magi_core bench --generate --models llama8b --prompt-tokens 2048 --new-tokens 32 --batch 1 \
    --cache dynamic --systems resident_compiled,magi,accelerate --policies HEURISTIC --ratios 0,0.9 --budgets 0.5 \
    --accelerate-budget 0.5 --accelerate-max-time "${SESSION_GEN_ACCEL_S:-60}" --time-budget "${SESSION_GEN_BUDGET:-500}" \
    --out "$OUT/generate-llama8b-h200.json" > "$OUT/generate.log" 2>&1 || rc=1
  tail -n 12 "$OUT/generate.log"
fi
exit $rc
