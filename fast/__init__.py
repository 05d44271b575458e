"""The fast layer: faster machinery for the same math, plugged into the core through one
seam (core/backend.py): attention kinds, packed linears, the weight formats' kernels,
huge-page memory, CPU tuning.
Imports only the core; every part is tested equal to the plain path."""
