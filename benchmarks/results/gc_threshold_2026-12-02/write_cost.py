# A loopback TCP write's CPU cost: back to back, and with a 100 µs gap (the reader asleep, woken by each write): python write_cost.py [gap]
import socket, os, time, sys
N = 20000
srv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen(1); port = srv.getsockname()[1]
pid = os.fork()
if pid == 0:
    c = socket.create_connection(('127.0.0.1', port)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    n = 0
    while True:
        d = c.recv(65536)
        if not d: break
    os._exit(0)
conn, _ = srv.accept(); conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
msg = b'x' * 200
t = time.perf_counter(); c0 = time.process_time()
for i in range(N):
    conn.send(msg)
    if sys.argv[1:] == ['gap']: 
        e = time.perf_counter() + 0.0001
        while time.perf_counter() < e: pass
dt = time.perf_counter() - t; cpu = time.process_time() - c0
print(sys.argv[1:], 'wall us/write', dt / N * 1e6, 'cpu us/write (incl gap)', cpu / N * 1e6)
conn.close(); os.waitpid(pid, 0)
