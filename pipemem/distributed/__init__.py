"""Estimation helpers for real distributed PyTorch runs (used by `pipemem validate dist`):
per-rank programs traced on fake tensors under PyTorch's fake process group (TP, FSDP), and
pipeline stage jobs plus a replay of torch.distributed.pipelining's runtime (what it keeps
alive between actions). Imports torch; import only when that feature is used."""
