"""The network: the Llama-family decoder over a flat token batch and its parts (attention over
the paged cache, rotary embeddings, norms and MLP, projections, the fused CPU decode step)."""
