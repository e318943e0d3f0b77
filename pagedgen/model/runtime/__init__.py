"""Running the model on the paged cache: the KV cache tensors, the flat batch built from
scheduled chunks, and the runner the engine drives."""
