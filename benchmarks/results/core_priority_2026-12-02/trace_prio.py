"""../api_front_2026-12-01/trace_run.py with three additions, spliced into its source: NICE=N renices the API
process's threads, CHRT=P makes the core's loop thread SCHED_FIFO P (chrt; the tree of 2026-12-02 before
server.core_realtime), and each thread's /proc schedstat before and after (its run-queue wait). On a copy
instrumented by ../api_front_2026-12-01/instrument.py and instrument_steps.py; then steps.py.

    python trace_prio.py --rounds 10 --root COPY
"""
from pathlib import Path

HERE = Path(__file__).resolve().parent
source = (HERE.parent / "api_front_2026-12-01" / "trace_run.py").read_text()
START = "proc, port = eo.start_null_server(args, 256, ['--device-ms', '5', '--set=lookahead=on'])\n"
SETUP = '''import subprocess as _sp
if os.environ.get("NICE"):
    for t in os.listdir(f"/proc/{proc.pid}/task"):
        _sp.run(["renice", "-n", os.environ["NICE"], "-p", t], stdout=_sp.DEVNULL)
def _ss():
    out = {}
    kids = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
    for name, pid in [("api", proc.pid)] + [("core", int(k)) for k in kids]:
        for t in os.listdir(f"/proc/{pid}/task"):
            try:
                c, w, n = map(int, open(f"/proc/{pid}/task/{t}/schedstat").read().split())
                comm = open(f"/proc/{pid}/task/{t}/comm").read().strip()
            except OSError:
                continue
            out[(name, t, comm)] = (c, w, n)
    return out
if os.environ.get("CHRT"):
    for k in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split():
        for t in os.listdir(f"/proc/{k}/task"):
            if open(f"/proc/{k}/task/{t}/comm").read().strip() == "cllm-core":
                _sp.run(["chrt", "-f", "-p", os.environ["CHRT"], t])
_s0 = _ss()
'''
JOINED = "for x in ps: x.join()\n"
REPORT = '''_s1 = _ss()
for k, v in _s1.items():
    b = _s0.get(k, (0, 0, 0)); c, w, n = (v[i] - b[i] for i in range(3))
    if c > 1e7:
        print("schedstat", k, f"cpu {c/1e9:.2f} s  runqueue wait {w/1e9:.2f} s  slices {n}  wait/slice {w/max(n,1)/1e3:.0f} us")
print("wall", wall)
'''
assert source.count(START) == 1 and source.count(JOINED) == 1, "trace_run.py changed: splice points not found"
source = source.replace(START, START + SETUP).replace(JOINED, JOINED + REPORT)
exec(compile(source, str(HERE / "trace_prio.py"), "exec"))
