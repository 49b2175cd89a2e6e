#!/usr/bin/env bash
# `ddpkit bench` across "hosts": one network namespace per rank, all on one bridge, each link
# optionally rate-limited with tc tbf (netem is absent from this kernel), so the comparison shows
# behaviour at 1 or 10 Gbit/s. Every rank runs in its own namespace with a torchrun-style
# environment; the namespaces, links and bridge are removed on exit, error or Ctrl-C. Needs root.
#
#   sudo bench/netns_bench.sh                                   # 2 trainers + 1 server, 1 Gbit/s, default hooks
#   sudo bench/netns_bench.sh --rate 10gbit --hooks allreduce,rpc -- --model DummyModel --max-iterations 10
#   sudo bench/netns_bench.sh --rate none --trainers 4 --servers 2
#
# Arguments after -- go to every `ddpkit bench` rank. The comparison and report.html are written
# to --out-dir (default bench-report-netns) as `ddpkit bench` does locally.
set -euo pipefail
cd "$(dirname "$0")/.."

RATE=1gbit TRAINERS=2 SERVERS=1 HOOKS=allreduce,fp16,int8,powersgd,rpc,sparse_rpc OUT=bench-report-netns
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --rate) RATE=$2; shift 2 ;;
    --trainers) TRAINERS=$2; shift 2 ;;
    --servers) SERVERS=$2; shift 2 ;;
    --hooks) HOOKS=$2; shift 2 ;;
    --out-dir) OUT=$2; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "netns_bench.sh: unknown option $1 (--rate R|none --trainers N --servers N --hooks LIST --out-dir D -- BENCH FLAGS)" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" = 0 ] || { echo "netns_bench.sh: needs root (ip netns, tc)" >&2; exit 2; }
DDPKIT=$(pwd)/build/ddpkit
[ -x "$DDPKIT" ] || { echo "netns_bench.sh: build first (./scripts/build.sh)" >&2; exit 2; }
WORLD=$((TRAINERS + SERVERS))
[ "$WORLD" -le 200 ] || { echo "netns_bench.sh: at most 200 ranks" >&2; exit 2; }

BRIDGE=ddpk-br0 PREFIX=10.78.0 PORT=29650
ns() { echo "ddpkit-rank$1"; }
cleanup() {
  for ((r = 0; r < WORLD; r++)); do
    ip netns pids "$(ns $r)" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$(ns $r)" 2>/dev/null || true
    ip link del "ddpk-h$r" 2>/dev/null || true
  done
  ip link del $BRIDGE 2>/dev/null || true
}
trap cleanup EXIT INT TERM
cleanup
ip link add $BRIDGE type bridge
ip link set $BRIDGE up
for ((r = 0; r < WORLD; r++)); do
  ip netns add "$(ns $r)"
  ip link add "ddpk-h$r" type veth peer name "ddpk-n$r"
  ip link set "ddpk-h$r" master $BRIDGE
  ip link set "ddpk-h$r" up
  ip link set "ddpk-n$r" netns "$(ns $r)"
  ip -n "$(ns $r)" link set "ddpk-n$r" name eth0
  ip -n "$(ns $r)" addr add "$PREFIX.$((r + 1))/24" dev eth0
  ip -n "$(ns $r)" link set lo up
  ip -n "$(ns $r)" link set eth0 up
  if [ "$RATE" != none ]; then
    # The burst must hold at least rate/HZ bytes or the link never reaches its rate.
    tc -n "$(ns $r)" qdisc add dev eth0 root tbf rate "$RATE" burst 2mb latency 50ms
  fi
done

mkdir -p "$OUT"
IFS=, read -ra HOOK_LIST <<<"$HOOKS"
for hook in "${HOOK_LIST[@]}"; do
  echo "netns_bench: $hook ($WORLD ranks, ${RATE} per link)" >&2
  pids=()
  for ((r = WORLD - 1; r >= 0; r--)); do
    # Rank 0 runs in the foreground (its output is the result); the others in the background.
    cmd=(ip netns exec "$(ns $r)" env MASTER_ADDR=$PREFIX.1 MASTER_PORT=$PORT RANK=$r LOCAL_RANK=0
         WORLD_SIZE=$WORLD LOCAL_WORLD_SIZE=1 GLOO_SOCKET_IFNAME=eth0 DDPKIT_PS_HOST=$PREFIX.$((r + 1))
         timeout 900 "$DDPKIT" bench --hook "$hook" --trainers "$TRAINERS" --servers "$SERVERS"
         --out-dir "$OUT/$hook" "${EXTRA[@]}")
    if [ "$r" -eq 0 ]; then "${cmd[@]}"; else "${cmd[@]}" >/dev/null & pids+=($!); fi
  done
  for p in "${pids[@]}"; do wait "$p"; done
done
"$DDPKIT" bench --hooks "$HOOKS" --out-dir "$OUT" --report-only "${EXTRA[@]}"
