#!/usr/bin/env bash
# Compression hooks over a rate-limited link: two network namespaces joined by a veth pair with a
# tc tbf limit on each side (netem is absent from this kernel), one rank in each. Measures step
# time, bytes per step and test accuracy of every hook against fp32 allreduce, and PyTorch's own
# hooks where they run, then removes the namespaces (also on error or Ctrl-C). Needs root.
#
#   sudo bench/netns_hooks.sh                  # 1 Gbit/s, 150 steps, the 24M-parameter MLP
#   sudo bench/netns_hooks.sh --rate 10gbit --steps 60 --pytorch-steps 15
#   sudo bench/netns_hooks.sh --steps 40 --only ddpkit:allreduce,ddpkit:int8
#
# Model: MLP 784-4096-4096-1024-10 (24.2M parameters) on Fashion-MNIST, batch 64 per rank, SGD.
# Accuracy is measured after the same number of steps for every hook. Step time is the median.
set -euo pipefail
cd "$(dirname "$0")/.."

RATE=1gbit
STEPS=150
PT_STEPS=20
DIMS=784,4096,4096,1024,10
OUT=""
ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --rate) RATE=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --pytorch-steps) PT_STEPS=$2; shift 2 ;;
    --mlp-dims) DIMS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    *) echo "unknown option $1 (--rate R --steps N --pytorch-steps N --mlp-dims D --out FILE --only impl:label,...)" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" = 0 ] || { echo "netns_hooks.sh: needs root (ip netns, tc)" >&2; exit 2; }
DDPKIT=build/ddpkit
[ -x "$DDPKIT" ] || { echo "netns_hooks.sh: build first (./scripts/build.sh)" >&2; exit 2; }

NS0=ddpkit-bench-a NS1=ddpkit-bench-b
A=10.77.0.1 B=10.77.0.2
cleanup() {
  ip netns pids $NS0 2>/dev/null | xargs -r kill 2>/dev/null || true
  ip netns pids $NS1 2>/dev/null | xargs -r kill 2>/dev/null || true
  ip netns del $NS0 2>/dev/null || true
  ip netns del $NS1 2>/dev/null || true
}
trap cleanup EXIT INT TERM
cleanup
ip netns add $NS0
ip netns add $NS1
ip link add ddpk-a type veth peer name ddpk-b
ip link set ddpk-a netns $NS0
ip link set ddpk-b netns $NS1
ip -n $NS0 addr add $A/24 dev ddpk-a
ip -n $NS1 addr add $B/24 dev ddpk-b
for ns in $NS0 $NS1; do ip -n $ns link set lo up; done
ip -n $NS0 link set ddpk-a up
ip -n $NS1 link set ddpk-b up
# tbf: the burst must hold at least rate/HZ bytes or the link never reaches its rate.
tc -n $NS0 qdisc add dev ddpk-a root tbf rate "$RATE" burst 2mb latency 50ms
tc -n $NS1 qdisc add dev ddpk-b root tbf rate "$RATE" burst 2mb latency 50ms

PORT=29611
# run_pair CMD...: rank 1 in namespace B, rank 0 in A (its stdout is the result), both bounded.
run_pair() {
  PORT=$((PORT + 1))
  local common=(WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=$A MASTER_PORT=$PORT OMP_NUM_THREADS=1)
  ip netns exec $NS1 env "${common[@]}" RANK=1 GLOO_SOCKET_IFNAME=ddpk-b timeout 900 "$@" >/dev/null 2>/tmp/ddpkit-bench-r1.log &
  local peer=$!
  ip netns exec $NS0 env "${common[@]}" RANK=0 GLOO_SOCKET_IFNAME=ddpk-a timeout 900 "$@" 2>/tmp/ddpkit-bench-r0.log | tail -1 || true
  wait $peer || true
}

RESULTS=$(mktemp)
# --only ddpkit:int8,pytorch:fp16 runs just those rows (ddpkit:allreduce is the ratios' base).
selected() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1:$2,"* ]]; }
ddpkit_run() {  # label, ddpkit train flags...
  local label=$1; shift
  selected ddpkit "$label" || return 0
  echo "  ddpkit  $label" >&2
  echo "ddpkit $label $(run_pair $DDPKIT train --dataset fashion-mnist --mlp-dims $DIMS --steps $STEPS \
    --batch-size 64 --threads 1 --quiet --timeout-s 600 "$@")" >>"$RESULTS"
}
pytorch_run() {  # label, pytorch_ddp.py flags...
  local label=$1; shift
  selected pytorch "$label" || return 0
  echo "  pytorch $label" >&2
  echo "pytorch $label $(run_pair /usr/bin/python3 bench/pytorch_ddp.py --mlp-dims $DIMS --steps $PT_STEPS \
    --batch-size 64 --timeout 600 "$@")" >>"$RESULTS"
}

echo "link: veth + tbf $RATE each way; model MLP $DIMS; $STEPS steps (PyTorch: $PT_STEPS, timing only)" >&2
ddpkit_run allreduce --hook allreduce
ddpkit_run noop --hook noop  # no communication: the compute floor
ddpkit_run fp16 --hook fp16
ddpkit_run bf16 --hook bf16
ddpkit_run int8 --hook int8
ddpkit_run int8+ef --hook int8 --int8-error-feedback
ddpkit_run quantize_per_tensor --hook quantize_per_tensor
ddpkit_run quantize_per_channel --hook quantize_per_channel
ddpkit_run powersgd-r4 --hook powersgd --powersgd-rank 4
ddpkit_run powersgd-r1 --hook powersgd --powersgd-rank 1
ddpkit_run batched_powersgd-r32 --hook batched_powersgd --powersgd-rank 32
ddpkit_run allreduce+sgd_in_hook --hook allreduce --optimizer-in-hook
pytorch_run allreduce --hook allreduce
pytorch_run fp16 --hook fp16
pytorch_run powersgd-r4 --hook powersgd --powersgd-rank 4
pytorch_run quantize_per_channel --hook quantize_per_channel

/usr/bin/python3 - "$RESULTS" "$RATE" <<'PY' | tee ${OUT:+"$OUT"}
import json, sys
rows = []
for line in open(sys.argv[1]):
    impl, label, rest = line.split(" ", 2)
    try:
        r = json.loads(rest)
    except ValueError:
        r = {"error": rest.strip()[:120] or "no output"}
    rows.append((impl, label, r))
base = next((r["median_step_ms"] for i, l, r in rows if i == "ddpkit" and l == "allreduce" and r.get("median_step_ms")), None)
print(f"link {sys.argv[2]}; step ratio = median step / ddpkit fp32 allreduce median step, measured in this run")
print(f"{'impl':8} {'hook':22} {'step ms':>9} {'ratio':>6} {'MB sent/step':>13} {'compr.':>7} {'test acc':>9}")
for impl, label, r in rows:
    if r.get("error") or not r.get("median_step_ms"):
        print(f"{impl:8} {label:22} {'-':>9} {'-':>6} {'-':>13} {'-':>7} {'-':>9}  error: {r.get('error')}")
        continue
    ms = r["median_step_ms"]
    sent = r.get("bytes_sent_per_step")
    acc = r.get("test_accuracy")
    print(f"{impl:8} {label:22} {ms:9.1f} {ms / base if base else float('nan'):6.2f} "
          f"{sent / 1e6 if sent is not None else float('nan'):13.2f} {r.get('compression_ratio', float('nan')):7.2f} "
          f"{acc if acc is not None else float('nan'):9.4f}")
PY
rm -f "$RESULTS"
