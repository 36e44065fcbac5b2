"""The real distributed PyTorch runs of `pipemem validate dist`: the small models' configs,
batches and optimizer (the model code is the product's, pipemem.traced.stack). Imports torch;
import only when that feature is used. Estimates come from `pipemem.estimate` (dist.py)."""
