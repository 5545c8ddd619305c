#!/usr/bin/env bash
# Sharing across ranks on a CUDA machine (one GPU is enough: two gloo ranks pin through the same device).
# Run from the repository root with magi-core and backends/cuda installed:
#     pip install --no-deps --no-build-isolation -e . -e backends/cuda
#     bash tests/host_workers/h200_sharing_check.sh [DENSE_MB]
# Prints, per isolation mode, what each rank ended with: mapping kind, bytes pinned, private copy bytes made
# by pinning (copy_on_write: ~ the weights under CUDA; read_only: 0), the arena's Pss (shared: ~half the
# weights per rank), and what a write on rank 0 did (copy_on_write: rank 0 sees +100, rank 1 nothing;
# read_only: the writing child dies with -11 and nobody sees anything). Then the CUDA tests of the host layer.
set -u
MB=${1:-256}
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
python3 -c "import magi_core; print('backend:', magi_core.get_backend().name)"
python3 tests/host_workers/cow_pin_probe.py --mib 256 | python3 -c "
import json, sys
d = json.load(sys.stdin)
print({k: v for k, v in d.items() if k != 'results'})
for r in d['results']:
    print(r)"
for mode in copy_on_write read_only; do
  dir=/dev/shm/magi-check-$mode out=/tmp/magi-check-$mode
  rm -rf "$dir" "$out"; mkdir -p "$dir" "$out"
  MAGI_SHM_DIR=$dir timeout 300 python3 -m torch.distributed.run --standalone --nproc-per-node=2 \
    --log-dir "$out/logs" --redirects 3 tests/host_workers/materialize_worker.py --out "$out" \
    --scenario write --shared-writes "$mode" --dense-mb "$MB" >/dev/null 2>&1
  echo "== $mode: torchrun exit $?"
  grep -rh "private copy\|read-only" "$out/logs" | cut -c1-240 | sort -u
  for r in 0 1; do
    python3 -c "
import json
d = json.load(open('$out/rank$r.json'))
print('rank $r', {k: d.get(k) for k in ('mode', 'mappings', 'weight_bytes', 'pinned_bytes', 'private_copy_bytes',
      'arena_pss', 'arena_rss', 'bias_delta', 'router_delta', 'param_write_child', 'buffer_write_child',
      'registered_after_release', 'dir_after')})" || true
  done
  rm -rf "$dir"
done
timeout 400 python3 -m pytest tests/host/test_host_accelerator.py tests/host/test_host_sharing.py -q -p no:cacheprovider 2>&1 | tail -15
