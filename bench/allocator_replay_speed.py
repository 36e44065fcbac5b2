"""CPU time per trace event of replaying every bundled snapshot (pipemem.allocator.snapshot.replay_device).

    PYTHONPATH=. python bench/allocator_replay_speed.py
"""
import glob, time, statistics
from pipemem.allocator import snapshot as S
files=sorted(glob.glob('bench/data/allocator_snapshots/*.json.gz'))
snaps=[S.load(f) for f in files]
n=sum(len(t) for s in snaps for t in s['device_traces'])
cpu=[]
for _ in range(3):
    c0=time.process_time()
    for s in snaps:
        for d in S.devices(s):
            S.replay_device(s,d)
    cpu.append(time.process_time()-c0)
c=statistics.median(cpu)
print(f"{len(files)} files, {n} trace events, replay_device cpu median {c:.2f} s, {c/n*1e6:.2f} us/event (each replay runs the trace twice: the peak state)")
