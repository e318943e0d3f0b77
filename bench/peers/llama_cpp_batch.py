"""llama.cpp's batch API running many sequences at once, greedy: the loop of its `batched`
example (prompts in batches of N_BATCH tokens, then one token per live sequence per decode
call). Runs under llama-cpp-python's interpreter (numpy and llama_cpp, no torch, no pagedgen):
bench_gguf_batch.py's llama.cpp child and the bench_peers runner run_llama_cpp.py."""

from __future__ import annotations

import time

N_BATCH = 512  # llama.cpp's prompt batch (its default n_batch)


class LlamaBatch:
    """One model and one context sized for `prompts` with their max_tokens."""

    def __init__(self, path: str, prompts: list[list[int]], max_tokens: list[int], threads: int):
        import llama_cpp

        self.llama_cpp, self.prompts, self.max_tokens = llama_cpp, prompts, max_tokens
        llama_cpp.llama_backend_init()
        self._quiet = llama_cpp.llama_log_callback(lambda *_: None)  # kept alive: llama.cpp calls it
        llama_cpp.llama_log_set(self._quiet, None)
        self.model = llama_cpp.llama_model_load_from_file(path.encode(),
                                                          llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        # The low-level context: Llama() has no n_seq_max. A KV stream per sequence (kv_unified
        # off), as llama.cpp advises for sequences that share no prefix: with one unified cache
        # every token attends over all sequences' cells under a mask (w64, default model, AMD
        # EPYC, 2 threads, 2026-12-02: 39.9 tok/s unified, 58.1 with a stream per sequence).
        params = llama_cpp.llama_context_default_params()
        per_sequence = max(len(p) + m for p, m in zip(prompts, max_tokens)) + 8
        params.n_ctx = per_sequence * len(prompts)
        params.n_batch = params.n_ubatch = N_BATCH
        params.n_seq_max, params.kv_unified = len(prompts), False
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(max(N_BATCH, len(prompts)), 0, 1)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """(token, position, sequence, wants logits) -> argmax of each wanted row."""
        import numpy as np

        llama_cpp, batch = self.llama_cpp, self.batch
        batch.n_tokens = len(entries)
        for i, (token, position, seq, wanted) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
            batch.seq_id[i][0], batch.logits[i] = seq, wanted
        if llama_cpp.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return [int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, i),
                                                     shape=(self.n_vocab,))))
                for i, entry in enumerate(entries) if entry[3]]

    def run(self, count: int) -> tuple[float, list[list[int]]]:
        """The first `count` requests from an empty cache: seconds and each one's tokens."""
        prompts, max_tokens = self.prompts[:count], self.max_tokens[:count]
        self.llama_cpp.llama_memory_clear(self.llama_cpp.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        outputs: list[list[int]] = [[] for _ in prompts]
        pending = [(t, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts)
                   for pos, t in enumerate(p)]
        firsts = []
        for at in range(0, len(pending), N_BATCH):
            firsts += self._decode(pending[at:at + N_BATCH])
        for s, token in enumerate(firsts):
            outputs[s].append(token)
        while live := [s for s in range(len(prompts)) if len(outputs[s]) < max_tokens[s]]:
            tokens = self._decode([(outputs[s][-1], len(prompts[s]) + len(outputs[s]) - 1, s, True)
                                   for s in live])
            for s, token in zip(live, tokens):
                outputs[s].append(token)
        return time.perf_counter() - start, outputs
