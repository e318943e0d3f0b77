"""CPU kernels: the torch backend (``backend``), the C sources beside it, their build-and-load
module (``native``, with ``native_cache`` for the private library cache) and the ctypes
bindings, and the batch-invariant attention (``invariant_attention``)."""
