"""API-process cost of handing a step's outputs to 256 streams' consumers: pump task vs sink (ProcessEngine._handle)."""
import asyncio, sys, time, statistics as st
from cllm.engine import process_engine as pe
from cllm.engine.core_protocol import StepOutputs, pack_output
from cllm.outputs import CompletionOutput, RequestMetrics, RequestOutput, Usage
from cllm.sampling.params import SamplingParams
from cllm.server.generation import GenerationStream, STREAM_END
from cllm.server.metrics import ServerMetrics

B, T = 256, 128

class Cmd:
    def send(self, m): pass
    def send_encoded(self, m): pass

def make_engine(sink_mode):
    e = object.__new__(pe.ProcessEngine)
    e._streams = {}; e._pending = 0; e._commands = Cmd(); e._dead = None; e._stopped = False; e._accepting = True
    e._snapshot = None; e._loop = asyncio.get_running_loop()
    class P:
        def is_alive(self): return True
    e._process = P()
    async def add(prompt, params, request_id, priority, timeout_s, on_queued, sink):
        s = pe._Stream(asyncio.Queue(), on_queued, prompt, [1, 2, 3], sink=sink)
        e._streams[request_id] = s
        on_queued and on_queued()
        return request_id, s
    e._add = add
    if not sink_mode:
        e.open_stream = None
    return e

def out(rid, i):
    fin = i == T - 1
    c = CompletionOutput(0, "", [], "length" if fin else None, None, None, " tok", [100 + i], None, None)
    return pack_output(RequestOutput(rid, None, [1, 2, 3], [c], fin, Usage(3, i + 1, 0), RequestMetrics(0, 0, 0, 0, 0), None, None))

async def run(sink_mode):
    e = make_engine(sink_mode)
    class Eng:  # GenerationStream sees open_stream only in sink mode
        config = None
    eng = Eng()
    eng.generate = e.generate
    if sink_mode:
        eng.open_stream = e.open_stream
    metrics = ServerMetrics(lambda: None).for_model("m")
    p = SamplingParams(max_tokens=T)
    streams = [GenerationStream(eng, [[1, 2, 3]], p, request_id=f"r{i}", priority=0, metrics=metrics, record=None, prompt_param="prompt") for i in range(B)]
    await asyncio.gather(*(s.start() for s in streams))
    got = [0]
    async def consume(s):
        while not isinstance(x := await s.next_output(), type(STREAM_END)):
            got[0] += 1
    consumers = [asyncio.ensure_future(consume(s)) for s in streams]
    await asyncio.sleep(0)
    steps = [StepOutputs([out(f"r{j}", i) for j in range(B)], None, settle=False) for i in range(T)]
    t0 = time.process_time()
    for msg in steps:
        e._handle(msg)
        for _ in range(4):
            await asyncio.sleep(0)
    await asyncio.gather(*consumers)
    dt = time.process_time() - t0
    for s in streams:
        await s.close()
    return dt / (B * T) * 1e6, got[0]

async def main():
    res = {False: [], True: []}
    for r in range(6):
        for m in (False, True) if r % 2 == 0 else (True, False):
            us, n = await run(m)
            res[m].append(us)
    print({("sink" if k else "pump"): [round(x, 2) for x in v] for k, v in res.items()})
    print("median µs/output: pump %.2f sink %.2f" % (st.median(res[False]), st.median(res[True])))
import uvloop
uvloop.run(main())
