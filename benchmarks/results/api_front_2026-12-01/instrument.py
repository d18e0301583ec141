"""Throwaway instrumentation for trace_run.py: run it in a *copy* of a checkout (cp -r), never in the working
tree. It adds trace points (string replacements, so it fits the trees of 2026-12-01: ac85ac4 and after): the
core's adds, steps and finishes, the API process's connection_made, headers, endpoint, command queued and
Admitted; each process writes its list to $CLLM_TRACE.<pid> / $CLLM_TRACE.api at exit (CLOCK_MONOTONIC)."""
p='cllm/engine/engine_core.py'; s=open(p).read()
s=s.replace("class EngineCore:", """import os as _os, json as _json
_TRACE = []


class EngineCore:""",1)
s=s.replace("""            self._finish(error)
""","""            self._finish(error)
            if _os.environ.get("CLLM_TRACE"):
                open(_os.environ["CLLM_TRACE"] + f".{_os.getpid()}", "w").write(_json.dumps(_TRACE))
""",1)
s=s.replace("""    def _add(self, command: AddRequest) -> None:
        error: BaseException | None = None""","""    def _add(self, command: AddRequest) -> None:
        _TRACE.append(("add", command.request_id, time.monotonic()))
        error: BaseException | None = None""")
s=s.replace("""            self._owe(sum(1 for out in outputs if out.finished))""","""            self._owe(sum(1 for out in outputs if out.finished))
            _now = time.monotonic()
            _TRACE.append(("step", 0, started, _now, len(self.engine.scheduler.running)))
            for _o in outputs:
                if _o.finished: _TRACE.append(("fin", _o.request_id, _now))""")
open(p,'w').write(s)
p='cllm/server/slow_clients.py'; s=open(p).read()
s=s.replace("""    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)""","""    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        from cllm.engine.engine_core import _TRACE
        import time as _t
        _TRACE.append(("conn", transport.get_extra_info("peername")[1], _t.monotonic()))
        super().connection_made(transport)""")
s=s.replace("""    def on_headers_complete(self) -> None:
        self._awaiting_headers = False""","""    def on_headers_complete(self) -> None:
        from cllm.engine.engine_core import _TRACE
        import time as _t
        _TRACE.append(("hdrs", self.transport.get_extra_info("peername")[1], _t.monotonic()))
        self._awaiting_headers = False""")
open(p,'w').write(s)
p='cllm/server/completions.py'; s=open(p).read()
s=s.replace('''    """Validate, admit and run one completions request."""
    state = get_state(request)''','''    """Validate, admit and run one completions request."""
    from cllm.engine.engine_core import _TRACE
    _t0 = time.monotonic()
    state = get_state(request)''')
s=s.replace('''    if record is not None:
        record.request_id = meta.id''','''    if record is not None:
        record.request_id = meta.id
    _TRACE.append(("endpoint", meta.id, _t0, request.scope["client"][1]))''')
open(p,'w').write(s)
p='cllm/engine/process_engine.py'; s=open(p).read()
s=s.replace('''        try:
            self._commands.send_encoded(message)
            sent = True''','''        try:
            from cllm.engine.engine_core import _TRACE
            _TRACE.append(("queued", rid, time.monotonic()))
            self._commands.send_encoded(message)
            sent = True''')
s=s.replace('''    def _admitted(self, message: Admitted) -> None:''','''    def _admitted(self, message: Admitted) -> None:
        from cllm.engine.engine_core import _TRACE
        _TRACE.append(("admitted", message.request_id, time.monotonic()))''')
open(p,'w').write(s)
p='cllm/bench/null_server.py'; s=open(p).read()
s=s.replace('''    if not args.sndbuf:
        server.run()
        return''','''    if not args.sndbuf:
        try:
            server.run()
        finally:
            import os as _os, json as _json
            from cllm.engine.engine_core import _TRACE
            if _os.environ.get("CLLM_TRACE"):
                open(_os.environ["CLLM_TRACE"] + ".api", "w").write(_json.dumps(_TRACE))
        return''')
open(p,'w').write(s)
