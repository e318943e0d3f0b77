"""Paged-KV kernels (shipped as ``pagedgen.kernels``). Imports nothing of pagedgen."""
