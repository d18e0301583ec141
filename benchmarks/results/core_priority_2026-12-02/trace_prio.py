# trace_run.py (../api_front_2026-12-01) plus: NICE=N renices the API process, CHRT=P makes the core loop SCHED_FIFO P (chrt), and /proc schedstat per thread (run-queue wait). On a copy instrumented by instrument.py + instrument_steps.py.
"""Per-request timeline across the client, the API process and the core at B streams (CLOCK_MONOTONIC in every
process), on a checkout instrumented by instrument.py (run from that checkout's copy):

    cp -r CHECKOUT /tmp/t && (cd /tmp/t && python3 .../instrument.py)
    (cd /tmp/t && /work/main/.venv/bin/python .../trace_run.py --rounds 10 --root /tmp/t)
"""
import asyncio, json, sys, time, multiprocessing as mp, glob, os, statistics, argparse
ROOT = sys.argv[sys.argv.index("--root") + 1] if "--root" in sys.argv else "/work/main"
sys.path.insert(0, ROOT + '/benchmarks'); sys.path.insert(0, ROOT)
import engine_overhead as eo
import uvloop
p = argparse.ArgumentParser(); p.add_argument("--b", type=int, default=256); p.add_argument("--rounds", type=int, default=8); p.add_argument("--tokens", type=int, default=128); p.add_argument("--root", default="/work/main")
a = p.parse_args()
BODY = json.dumps({"prompt": [300 + j % 500 for j in range(150)], "max_tokens": a.tokens, "stream": True, "ignore_eos": True,
                   "stream_options": {"include_usage": True}, "temperature": 0.0}).encode()
EV = []
async def stream(port):
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    tc = time.monotonic(); lport = writer.get_extra_info("sockname")[1]
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: " + str(len(BODY)).encode() + b"\r\nConnection: close\r\n\r\n" + BODY)
    first = rid = hdr = None; buf = b""; events = 0
    while chunk := await reader.read(1 << 16):
        now = time.monotonic()
        if hdr is None: hdr = now
        events += chunk.count(b"data: ")
        if first is None:
            buf += chunk
            i = buf.find(b'"id":"')
            if i >= 0 and b"data: " in buf:
                first = now; rid = buf[i+6:buf.index(b'"', i+6)].decode()
    done = time.monotonic(); writer.close()
    EV.append(events)
    return (rid, t0, tc, hdr, first, done, lport)
def client(port, n, rounds, q):
    async def loop():
        return [await stream(port) for _ in range(rounds)]
    async def run():
        return [r for l in await asyncio.gather(*(loop() for _ in range(n))) for r in l]
    r = uvloop.run(run())
    q.put(r)
    print("events per request (incl. first, finish/usage/DONE):", sum(EV)/len(EV), flush=True)
for f in glob.glob("/tmp/w/tt.*"): os.remove(f)
os.environ["CLLM_TRACE"] = "/tmp/w/tt"
args = eo.argparse.Namespace(device_ms=5.0, step_ms=0.0, token_us=0.0, vocab=1024, device='numpy', set=[], levels=[a.b], prompt_len=150, tokens=a.tokens, client_procs=2, min_tokens=1, rounds=a.rounds, keep_alive=False, modes=["greedy"])
proc, port = eo.start_null_server(args, 256, ['--device-ms', '5', '--set=lookahead=on'])
import subprocess as _sp
if os.environ.get("NICE"): [_sp.run(["renice", "-n", os.environ["NICE"], "-p", t], stdout=_sp.DEVNULL) for t in os.listdir(f"/proc/{proc.pid}/task")]; print("reniced", os.environ.get("NICE"))
q = mp.Queue()
ps = [mp.Process(target=client, args=(port, a.b // 2, a.rounds, q)) for _ in range(2)]
def _ss():
    out = {}
    kids = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
    for name, pid in [("api", proc.pid)] + [("core", int(k)) for k in kids]:
        for t in os.listdir(f"/proc/{pid}/task"):
            try:
                c, w, n = map(int, open(f"/proc/{pid}/task/{t}/schedstat").read().split())
                comm = open(f"/proc/{pid}/task/{t}/comm").read().strip()
            except OSError: continue
            out[(name, t, comm)] = (c, w, n)
    return out
if os.environ.get("CHRT"):
    for k in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split():
        for t in os.listdir(f"/proc/{k}/task"):
            if open(f"/proc/{k}/task/{t}/comm").read().strip() == "cllm-core":
                _sp.run(["chrt", "-f", "-p", os.environ["CHRT"], t]); print("chrt", t)
_s0 = _ss()
w0 = time.monotonic()
for x in ps: x.start()
res = q.get() + q.get()
wall = time.monotonic() - w0
for x in ps: x.join()
_s1 = _ss()
for k, v in _s1.items():
    b = _s0.get(k, (0, 0, 0)); c, w, n = (v[i] - b[i] for i in range(3))
    if c > 1e7: print("schedstat", k, f"cpu {c/1e9:.2f} s  runqueue wait {w/1e9:.2f} s  slices {n}  wait/slice {w/max(n,1)/1e3:.0f} us")
print("wall", wall)
proc.terminate(); proc.wait()
tr = json.load(open([f for f in glob.glob("/tmp/w/tt.*") if f[-1].isdigit()][0]))
add = {x[1]: x[2] for x in tr if x[0] == "add"}; fin = {x[1]: x[2] for x in tr if x[0] == "fin"}
print("tok/s", a.b * a.rounds * a.tokens / wall, "ratio", a.b * a.rounds * a.tokens / wall / (1000 * a.b / 5))
rows = [r for r in res if r[0] in add and r[0] in fin]
def q_(xs): xs = sorted(xs); return f"p10 {1000*xs[len(xs)//10]:6.1f}  p50 {1000*xs[len(xs)//2]:6.1f}  p90 {1000*xs[len(xs)*9//10]:6.1f}  mean {1000*statistics.mean(xs):6.1f} ms"
print("connect          ", q_([r[2]-r[1] for r in rows]))
print("start -> core add", q_([add[r[0]]-r[1] for r in rows]))
print("core add -> first data at client", q_([r[4]-add[r[0]] for r in rows]))
print("core fin -> client done", q_([r[5]-fin[r[0]] for r in rows]))
api = json.load(open("/tmp/w/tt.api"))
conn, hdrs = {}, {}
for x in api:
    if x[0] == "conn": conn.setdefault(x[1], []).append(x[2])
    if x[0] == "hdrs": hdrs.setdefault(x[1], []).append(x[2])
ep = {x[1]: x[2] for x in api if x[0] == "endpoint"}
adm = {x[1]: x[2] for x in api if x[0] == "admitted"}
# queued -> put -> wrote in FIFO order
puts = [x[2] for x in api if x[0] == "put"]; wrotes = [x[2] for x in api if x[0] == "wrote"]
qd = {}
pi = 0
seq = [x for x in api if x[0] in ("queued", "put")]
order = []
for i, x in enumerate(seq):
    if x[0] == "queued": order.append((x[1], len([y for y in seq[:i+1] if y[0] == "put"])))
# the put right after 'queued' is number k (0-based = count of puts before it)
for rid, k in order:
    if k < len(wrotes): qd[rid] = (puts[k], wrotes[k])
def near(lst, t0):
    c = [t for t in lst if t >= t0 - 0.001]
    return min(c) if c else None
qq = {x[1]: x[2] for x in api if x[0] == "queued"}
qd = {k: (v, v) for k, v in qq.items()}
R = [r for r in rows if r[0] in ep and r[0] in qq and r[0] in adm]
print("n", len(R))
print("start -> conn_made", q_([near(conn.get(r[6], []), r[1]) - r[1] for r in R if near(conn.get(r[6], []), r[1])]))
print("conn_made -> hdrs", q_([near(hdrs.get(r[6], []), r[1]) - near(conn.get(r[6], []), r[1]) for r in R if near(hdrs.get(r[6], []), r[1])]))
print("hdrs -> endpoint", q_([ep[r[0]] - near(hdrs.get(r[6], []), r[1]) for r in R if near(hdrs.get(r[6], []), r[1])]))
print("endpoint -> queued", q_([qq[r[0]] - ep[r[0]] for r in R]))
st = [x for x in tr if x[0] == "step"]
import statistics as S
mid = st[len(st)//4: 3*len(st)//4]
iv = [mid[i+1][2] - mid[i][2] for i in range(len(mid)-1)]
print("middle half: mean running %.1f, step interval mean %.2f ms, p50 %.2f, p90 %.2f; step wall (launch->done) mean %.2f" % (S.mean(x[4] for x in mid), 1000*S.mean(iv), 1000*sorted(iv)[len(iv)//2], 1000*sorted(iv)[len(iv)*9//10], 1000*S.mean(x[3]-x[2] for x in mid)))
print("queued -> core add", q_([add[r[0]] - qq[r[0]] for r in R]))
print("core add -> api admitted", q_([adm[r[0]] - add[r[0]] for r in R]))

print("core add -> core fin", q_([fin[r[0]]-add[r[0]] for r in rows]))
# slot idle per request: (core fin of prev) -> (core add of next) ~ fin->done + done->start(≈0) + start->add
print("idle per request ≈ fin->done + start->add", q_([ (r[5]-fin[r[0]]) for r in rows]))
