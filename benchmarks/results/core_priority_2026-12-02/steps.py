# Per core loop iteration (middle half of trace_prio.py's run): wall interval, thread CPU, sleeps in the device wait, and the rest (off-CPU: run-queue or GIL waits).
import json, glob, statistics as S
tr = json.load(open([f for f in glob.glob("/tmp/w/tt.*") if f[-1].isdigit()][0]))
st = [x for x in tr if x[0] == "step"]
mid = st[len(st)//4: 3*len(st)//4]
rows = []
for a, b in zip(mid, mid[1:]):
    iv = b[2]-a[2]; cpu = b[5]-a[5]; slept = b[8]-a[8]
    rows.append((iv, cpu, slept, iv-cpu-slept, a[7], a[4], a[9]))
def pr(name, sel):
    if not sel: print(name, 0); return
    print(f"{name:28s} n {len(sel):5d}  interval {1000*S.mean(r[0] for r in sel):5.2f}  cpu {1000*S.mean(r[1] for r in sel):5.2f}  slept {1000*S.mean(r[2] for r in sel):5.2f}  off-cpu {1000*S.mean(r[3] for r in sel):5.2f} adds {S.mean(r[4] for r in sel):4.1f} running {S.mean(r[5] for r in sel):5.1f}")
pr("all", rows)
pr("interval<=5.3", [r for r in rows if r[0] <= 0.0053])
pr("5.3<interval<=6.5", [r for r in rows if 0.0053 < r[0] <= 0.0065])
pr("interval>6.5", [r for r in rows if r[0] > 0.0065])
pr("adds>0", [r for r in rows if r[4] > 0])
pr("adds==0", [r for r in rows if r[4] == 0])
tot = sum(r[0] for r in rows); ex = sum(max(0, r[0]-0.005) for r in rows)
print("excess over 5ms share of time", ex/tot)
for k in ("cpu>5", ):
    sel=[r for r in rows if r[1] > 0.005]; print("cpu>5ms iterations", len(sel), "excess from them", sum(r[0]-0.005 for r in sel)/tot)
sel=[r for r in rows if r[0] > 0.0055 and r[1] < 0.0045]; print("long but cpu<4.5", len(sel), "excess", sum(r[0]-0.005 for r in sel)/tot)
asked = sum(b[10]-a[10] for a, b in zip(mid, mid[1:])); actual = sum(b[8]-a[8] for a, b in zip(mid, mid[1:]))
print(f"sleep asked {1000*asked/len(rows):.2f} ms/iter, actual {1000*actual/len(rows):.2f}")
