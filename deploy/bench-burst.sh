#!/usr/bin/env bash
# Benchmark (not a test) of the adaptive listener: a burst of work after idleness. Prints the
# processor's timeline of active consumers (sampled from its GET /state every 50 ms), the time from the
# burst to max consumers, messages per second, and the SQS requests the processor and controller make
# while the queues are empty (per minute, over IDLE_SECS), with the listener settings in use.
#
#   deploy/bench-burst.sh [ROWS] [CHUNK_SIZE]     defaults: 1000000 transactions, chunks of 5000
#   IDLE_SECS=120 (idle window, measured after a settling period of one receive wait + 5 s)
set -euo pipefail
rows=${1:-1000000}
chunk=${2:-5000}
idle=${IDLE_SECS:-120}
source "$(dirname "${BASH_SOURCE[0]}")/bench-setup.sh"
python3 - "$bin" "$data" "$chunk" "$idle" "$repo/target/release/processor" <<'PY'
import json, os, re, subprocess, sys, threading, time, urllib.request
bin_, data, chunk, idle, processor = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
# The settings in effect: the environment where set, else each flag's default (from --help).
helptext = subprocess.run([processor, "--help"], capture_output=True, text=True).stdout
settings = {m[0]: os.environ.get(m[0], m[1]) for m in re.findall(r"\[env: (LISTENER_\w+)=[^\]]*\]\s*(?:\[default: ([^\]]*)\])?", helptext)}
print("listener settings: " + " ".join(f"{k[9:].lower()}={v or '-'}" for k, v in settings.items()))
def state(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/state?depth=false", timeout=2) as r:
        return json.load(r)
p0 = state(9110)[0]
print(f"processor before the burst: {p0['consumers_active']} active / {p0['consumers_total']} consumers (max {p0['consumers_max']}), "
      f"concurrency {p0['concurrency_limit']}, buffer {p0['buffer_capacity']}")
samples, stop = [], threading.Event()
def sample():
    while not stop.is_set():
        try:
            s = state(9110)[0]
            samples.append((time.time(), s["consumers_active"], s["received"]))
        except Exception:
            pass
        time.sleep(0.05)
t = threading.Thread(target=sample); t.start()
t0 = time.time()
out = subprocess.run([bin_, "submit", data, "--chunk-size", chunk, "--wait", "--json"], capture_output=True, text=True)
t1 = time.time()
stop.set(); t.join()
if out.returncode != 0:
    print(out.stderr); sys.exit(1)
report = json.loads(out.stdout)
msgs = samples[-1][2] - p0["received"] if samples else 0
print(f"burst: {report['transactions']['processed']} transactions, {report['chunks']['total'] if isinstance(report.get('chunks'), dict) else msgs} chunks; "
      f"submit -> report {t1 - t0:.2f} s; {msgs} work items received, {msgs / (t1 - t0):.0f} msgs/s")
timeline, last = [], None
for ts, n, _ in samples:
    if n != last:
        timeline.append((ts - t0, n)); last = n
print("active consumers over time (s, n): " + ", ".join(f"{a:.2f}:{n}" for a, n in timeline))
peak = max((n for _, n in timeline), default=0)
first_work = next((ts for ts, _, r in samples if r > p0["received"]), None)
at_peak = next((ts for ts, n, _ in samples if n == peak), None)
if first_work and at_peak:
    print(f"peak {peak} consumers (max {p0['consumers_max']}); first work received {first_work - t0:.2f} s after submit; "
          f"peak reached {at_peak - first_work:.2f} s after that")
def receives():
    return {port: sum(s["receives"] for s in state(port)) for port in (9110, 9102)}
# Settling: the last long polls of the burst's consumers end (one receive wait + margin).
settle = int(settings.get("LISTENER_RECEIVE_WAIT_SECS") or 20) + 5
a = receives(); time.sleep(settle); b = receives(); time.sleep(idle); c = receives()
for port, name in ((9110, "processor"), (9102, "controller")):
    n = c[port] - b[port]
    print(f"idle: {name} made {b[port] - a[port]} ReceiveMessage calls in the {settle} s after the burst, then {n} in {idle} s "
          f"({n * 60 / idle:.1f}/min); now {state(port)[0]['consumers_active']} active consumers")
PY
