#!/usr/bin/env bash
# Fault drill, by hand: a monitor and three peers on 127.0.0.1, as an operator would start them. Peer 1 is
# SIGKILLed at global step 4; peer 2 is stopped with Ctrl-C (SIGINT) at step 8 and started again. The drill passes
# when the global step keeps advancing to 16, the monitor stops counting the departed peers, and every checkpoint
# the monitor saved is on disk and matches its manifest's sha256. About 3 minutes on 2 CPU cores.
#
#   bash docs/fault_drill.sh            (after `make setup`; logs and checkpoints in outputs/fault_drill/)
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
D=${DRILL_DIR:-outputs/fault_drill}
rm -rf "$D" && mkdir -p "$D"
PREFIX=drill$(date +%s)
PORT=${DRILL_PORT:-31337}
FAST=(--target_batch_size 256 --matchmaking_time 2 --averaging_timeout 15)
PEERS=()
trap 'kill -KILL "${PEERS[@]}" ${MONITOR:-} 2>/dev/null' EXIT

say() { echo "$(date +%H:%M:%S) $*" | tee -a "$D/events.log"; }
last_step() { tail -n 1 "$D/metrics.jsonl" 2>/dev/null | sed -n 's/.*"step": \([0-9]*\).*/\1/p'; }
wait_for_step() {  # poll the monitor's metrics file until it reports step $1, for at most 300 s
  local deadline=$((SECONDS + 300))
  until [ "$(last_step)" -ge "$1" ] 2>/dev/null; do
    [ $SECONDS -lt $deadline ] || { say "FAILED: no global step $1 within 300 s"; exit 1; }
    sleep 1
  done
  say "monitor reports step $(last_step)"
}
# the last `event` line of an events file (docs/EVENTS.md), or nothing
last_event() { $PY -c 'import sys; from collab.events import read_events; found = read_events(sys.argv[1], sys.argv[2])
print(repr(found[-1]) if found else "")' "$1" "$2" 2>/dev/null; }
start_peer() {  # start_peer N: a trainer whose pid lands in PEERS[N]
  $PY run_trainer.py --experiment_prefix "$PREFIX" "${FAST[@]}" "${JOIN[@]}" --output_dir "$D/peer$1" \
    --events_path "$D/peer$1.events.jsonl" >> "$D/peer$1.log" 2>&1 &
  PEERS[$1]=$!
}

$PY run_training_monitor.py --experiment_prefix "$PREFIX" "${FAST[@]}" --host_maddrs "/ip4/127.0.0.1/tcp/$PORT" \
  --identity_path "$D/monitor.key" --refresh_period 2 --metrics_path "$D/metrics.jsonl" --store_checkpoints \
  --repo_path "$D/checkpoints" --save_checkpoint_step_interval 2 --keep_checkpoints 100 \
  --events_path "$D/monitor.events.jsonl" > "$D/monitor.log" 2>&1 &
MONITOR=$!
deadline=$((SECONDS + 120))
until [ -n "$(last_event "$D/monitor.events.jsonl" joined)" ]; do
  [ $SECONDS -lt $deadline ] || { say "FAILED: the monitor's DHT was not up in 120 s"; exit 1; }
  sleep 1
done
JOIN=(--initial_peers $($PY -c 'import sys; from collab.events import read_events
print(" ".join(read_events(sys.argv[1], "joined")[-1]["address"]))' "$D/monitor.events.jsonl"))
say "monitor up: ${JOIN[*]}"
for n in 1 2 3; do start_peer $n; done
say "three peers started"

wait_for_step 4
kill -KILL "${PEERS[1]}"
say "peer 1 SIGKILLed"
wait_for_step 8
kill -INT "${PEERS[2]}"
wait "${PEERS[2]}"
say "peer 2 stopped by SIGINT, exit code $?; starting it again"
start_peer 2
wait_for_step 16
say "restarted peer 2: $(last_event "$D/peer2.events.jsonl" started)"
kill -INT "${PEERS[2]}" "${PEERS[3]}"
wait "${PEERS[2]}"; code2=$?
wait "${PEERS[3]}"; code3=$?
kill -INT $MONITOR
wait $MONITOR; code_monitor=$?
say "peers 2 and 3 exit codes $code2 $code3, monitor $code_monitor"

$PY - "$D" <<'PYTHON'
import json
import sys
from pathlib import Path

from collab.checkpoint import list_checkpoints
from collab.events import read_events

folder = Path(sys.argv[1])
lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
steps = [line["step"] for line in lines]
saved = sorted({event["step"] for event in read_events(folder / "monitor.events.jsonl", "checkpoint_saved")})
valid, invalid = list_checkpoints(folder / "checkpoints")
lost = sorted(set(saved) - {manifest.step for _, manifest in valid})
print("step  alive_peers  loss  samples/s")
for line in lines:
    print(f"{line['step']:>4}  {line['alive_peers']:>11}  {line['loss']:.3f}  {line['samples_per_second']:.1f}")
print(f"steps {steps[0]}..{steps[-1]} in {len(steps)} lines, strictly increasing: {steps == sorted(set(steps))}")
print(f"checkpoints saved {saved}, valid on disk {sorted(m.step for _, m in valid)}, invalid {len(invalid)}")
print(f"checkpoints lost: {len(lost)}")
sys.exit(0 if steps == sorted(set(steps)) and steps[-1] >= 16 and not lost and not invalid else 1)
PYTHON
