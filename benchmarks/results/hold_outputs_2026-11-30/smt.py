"""Two single-thread CPU loops, alone then at once: how fast this VM runs its two vCPUs right now."""
import time, multiprocessing as mp
def work(q):
    t = time.process_time(); s = 0
    for i in range(20_000_000): s += i
    q.put(time.process_time() - t)
if __name__ == "__main__":
    q = mp.Queue()
    p = mp.Process(target=work, args=(q,)); p.start(); p.join(); print("alone", q.get())
    ps = [mp.Process(target=work, args=(q,)) for _ in range(2)]
    [p.start() for p in ps]; [p.join() for p in ps]; print("two at once", q.get(), q.get())
