"""The Paddle cases of `pipemem validate paddle`: models (legacy and PIR), the executor
measurements, the comparison with pipemem and with Paddle's own estimator, and the worker
process they run in (Paddle and PyTorch never share a process)."""
