#!/usr/bin/env bash
# Hierarchical allreduce on two "hosts": two network namespaces joined by a veth pair (rate-limited
# with tc tbf each way), two ranks in each. Ranks in one namespace share memory; between the
# namespaces Gloo carries one shard per rank pair. Runs `collective_bench --processes`, which
# checks the result equals flat Gloo's bit for bit and times both. The namespaces and link are
# removed on exit, error or Ctrl-C. Needs root (exit 77, "skipped", without it).
#
#   sudo bench/netns_hierarchical.sh                      # 1 Gbit/s, 1/25/100 MiB, 5 reps
#   sudo bench/netns_hierarchical.sh --sizes-mb 0.004,0.064,1   # latency-bound sizes (4 KiB, 64 KiB)
#   sudo bench/netns_hierarchical.sh --rate none --sizes-mb 1 --reps 1   # the ctest check
set -euo pipefail
cd "$(dirname "$0")/.."

RATE=1gbit SIZES=1,25,100 REPS=5 PER_HOST=2
while [ $# -gt 0 ]; do
  case "$1" in
    --rate) RATE=$2; shift 2 ;;
    --sizes-mb) SIZES=$2; shift 2 ;;
    --reps) REPS=$2; shift 2 ;;
    --per-host) PER_HOST=$2; shift 2 ;;
    *) echo "netns_hierarchical.sh: unknown option $1 (--rate R|none --sizes-mb LIST --reps N --per-host N)" >&2; exit 2 ;;
  esac
done
BENCH=${COLLECTIVE_BENCH:-$(pwd)/build/collective_bench}
[ -x "$BENCH" ] || { echo "netns_hierarchical.sh: build first (collective_bench)" >&2; exit 2; }
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null; then echo "netns_hierarchical.sh: needs root and ip: skipped" >&2; exit 77; fi

TAG=ddpkh$$ A=10.79.$(($$ % 200)).1 B=10.79.$(($$ % 200)).2 PORT=$((29800 + $$ % 100))
cleanup() {
  for n in ${TAG}a ${TAG}b; do
    ip netns pids $n 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del $n 2>/dev/null || true
  done
}
trap cleanup EXIT INT TERM
ip netns add ${TAG}a 2>/dev/null || { echo "netns_hierarchical.sh: cannot create network namespaces here: skipped" >&2; exit 77; }
ip netns add ${TAG}b
ip link add ${TAG}x type veth peer name ${TAG}y
ip link set ${TAG}x netns ${TAG}a
ip link set ${TAG}y netns ${TAG}b
ip -n ${TAG}a addr add $A/24 dev ${TAG}x
ip -n ${TAG}b addr add $B/24 dev ${TAG}y
for n in ${TAG}a ${TAG}b; do ip -n $n link set lo up; done
ip -n ${TAG}a link set ${TAG}x up
ip -n ${TAG}b link set ${TAG}y up
if [ "$RATE" != none ]; then
  tc -n ${TAG}a qdisc add dev ${TAG}x root tbf rate "$RATE" burst 2mb latency 50ms
  tc -n ${TAG}b qdisc add dev ${TAG}y root tbf rate "$RATE" burst 2mb latency 50ms
fi
echo "# $((2 * PER_HOST)) ranks over 2 network namespaces ($PER_HOST each), link ${RATE} each way"

WORLD=$((2 * PER_HOST))
pids=()
for ((r = WORLD - 1; r >= 0; r--)); do
  if [ $r -lt $PER_HOST ]; then ns=${TAG}a if=${TAG}x; else ns=${TAG}b if=${TAG}y; fi
  ip netns exec $ns env RANK=$r WORLD_SIZE=$WORLD LOCAL_RANK=$((r % PER_HOST)) MASTER_ADDR=$A MASTER_PORT=$PORT \
    GLOO_SOCKET_IFNAME=$if OMP_NUM_THREADS=1 timeout 600 "$BENCH" --processes --reps "$REPS" --sizes-mb "$SIZES" &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
exit $status
