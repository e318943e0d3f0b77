"""CUDA kernels in Triton (``ops`` has the backend's signatures; the kernels sit beside it).
Imported only when a CUDA device asks for them, so CPU users never load Triton."""
