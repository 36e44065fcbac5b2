"""The real distributed PyTorch runs of `pipemem validate dist`: the small models, their
per-rank traces on fake tensors under PyTorch's fake process group (TP, FSDP), and pipeline
stage jobs. Imports torch; import only when that feature is used."""
