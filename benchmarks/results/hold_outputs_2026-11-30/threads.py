"""The CPU time per streamed token of each thread of the null server (API process) and its engine core, one
server and one 8-round closed loop at 256 streams, --device-ms 5, lookahead on:  python threads.py greedy|top_p"""
import sys, os, subprocess, time
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../..")); sys.path.insert(0, ROOT + "/benchmarks"); sys.path.insert(0, ROOT)
import engine_overhead as eo
mode = sys.argv[1] if len(sys.argv) > 1 else "greedy"
args = eo.argparse.Namespace(device_ms=5.0, step_ms=0.0, token_us=0.0, vocab=1024, device="numpy", set=[], levels=[256],
    prompt_len=150, tokens=128, client_procs=2, min_tokens=0, rounds=8, keep_alive=False, modes=[mode])
proc, port = eo.start_null_server(args, 256, ["--device-ms", "5", "--set=lookahead=on"])
tick = os.sysconf("SC_CLK_TCK")
def threads(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        f = open(f"/proc/{pid}/task/{tid}/stat").read()
        name = f[f.index("(")+1:f.rindex(")")]; rest = f[f.rindex(")")+2:].split()
        out[f"{pid}:{name}:{tid}"] = (int(rest[11]) + int(rest[12])) / tick
    return out
try:
    kids = [int(x) for x in subprocess.check_output(["pgrep", "-P", str(proc.pid)]).split()]
    core = [k for k in kids if b"resource_tracker" not in open(f"/proc/{k}/cmdline","rb").read()][0]
    b = {**threads(proc.pid), **threads(core)}
    a = eo.server_us_per_token(port, proc.pid, 256, mode, args)
    e = {**threads(proc.pid), **threads(core)}
    for k in e:
        d = e[k] - b.get(k, 0)
        if d > 0.05: print(f"{k:40s} {d*1e6/a['tokens']:6.2f} us/token")
    print(mode, round(a["tok_s"]/51200, 3))
finally:
    proc.terminate(); proc.wait()
