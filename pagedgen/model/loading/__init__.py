"""Getting a model into memory: HF folders (safetensors), GGUF files, the built-in default
model, configs and tokenizers."""
