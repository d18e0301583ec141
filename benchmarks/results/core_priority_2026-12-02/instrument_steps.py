"""Throwaway, on a copy already instrumented by ../api_front_2026-12-01/instrument.py (cp -r; never the working
tree): per step of the core, its thread CPU time, the adds taken, and the simulated device's sleeps (asked and
actual), for steps.py. Run from the copy: python3 instrument_steps.py; then trace_prio.py --root COPY."""
p = 'cllm/engine/engine_core.py'; s = open(p).read()
s = s.replace("""            _TRACE.append(("step", 0, started, _now, len(self.engine.scheduler.running)))""",
              """            _TRACE.append(("step", 0, started, _now, len(self.engine.scheduler.running), _pre, time.thread_time(), taken, _slept[0], len(outputs), _slept[1]))""")
s = s.replace("""            if was_idle:
                self._gather_burst(taken)""", """            if was_idle:
                self._gather_burst(taken)
            _pre = time.thread_time()""")
s = s.replace("import os as _os, json as _json\n", "import os as _os, json as _json\nfrom cllm.bench.null_backend import _slept\n")
open(p, 'w').write(s)
p = 'cllm/bench/null_backend.py'; s = open(p).read()
s = s.replace("""        if done is not None and (left := done - time.perf_counter()) > 0:
            time.sleep(left)""", """        if done is not None and (left := done - time.perf_counter()) > 0:
            _t0 = time.perf_counter()
            time.sleep(left)
            _slept[0] += time.perf_counter() - _t0
            _slept[1] += left""")
s = s.replace("EOS_ID = 0\n", "EOS_ID = 0\n_slept = [0.0, 0.0]\n")
open(p, 'w').write(s)
