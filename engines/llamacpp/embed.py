"""Embeddings on llama.cpp: a second context on the already loaded model, with embeddings on.

It runs on the batch scheduler's thread (between generation steps), so it never races the
generation context, and its batches never share a `llama_decode` with generation. Several inputs
go into one decode as separate sequences (each in its own KV stream) and come back pooled by
llama.cpp (`llama_get_embeddings_seq`).
"""

from __future__ import annotations

import logging
from typing import Any

import llama_cpp as lc
import numpy as np
import numpy.typing as npt

from engines.base import ContextLengthExceeded, EngineFailure, InvalidGenerationRequest

log = logging.getLogger(__name__)

POOLING = {"mean": lc.LLAMA_POOLING_TYPE_MEAN, "cls": lc.LLAMA_POOLING_TYPE_CLS, "last": lc.LLAMA_POOLING_TYPE_LAST}
# Sequences embedded together in one decode.
MAX_SEQS = 8


class Embedder:
    """Created on first use; every call happens on the scheduler thread."""

    def __init__(self, model: Any, n_ctx: int, n_vocab: int, n_threads: int, pooling: str, normalize: bool) -> None:
        self._model = model
        self._n_ctx = n_ctx
        self._n_vocab = n_vocab
        self._n_threads = n_threads
        self._pooling = POOLING[pooling]
        self._normalize = normalize
        self.width = lc.llama_model_n_embd(model)
        self._ctx: Any = None
        self._batch: Any = None

    def check(self, inputs: list[list[int]]) -> None:
        """What makes a request invalid, found before it is queued."""
        for i, ids in enumerate(inputs):
            if not ids:
                raise InvalidGenerationRequest(f"input[{i}] is empty", param="input")
            if len(ids) > self._n_ctx:
                raise ContextLengthExceeded(len(ids), self._n_ctx)
            bad = next((t for t in ids if not 0 <= t < self._n_vocab), None)
            if bad is not None:
                raise InvalidGenerationRequest(
                    f"input[{i}] has token id {bad}, outside the vocabulary (0..{self._n_vocab - 1})", param="input"
                )

    def _open(self) -> None:
        p = lc.llama_context_default_params()
        # One decode holds at most n_ctx tokens in all (see embed()), so that is all the KV needed.
        p.n_ctx = self._n_ctx
        p.n_batch = p.n_ubatch = self._n_ctx  # pooling needs a whole sequence in one micro-batch
        p.n_seq_max = MAX_SEQS
        p.kv_unified = True  # one stream, sequences kept apart by the attention mask
        p.embeddings = True
        p.pooling_type = self._pooling
        p.n_threads = p.n_threads_batch = self._n_threads
        p.no_perf = True
        ctx = lc.llama_init_from_model(self._model, p)
        if not ctx:
            raise EngineFailure(f"llama.cpp could not create an embedding context of {p.n_ctx} tokens")
        self._ctx = ctx
        self._batch = lc.llama_batch_init(self._n_ctx, 0, 1)

    def embed(self, inputs: list[list[int]]) -> npt.NDArray[np.float32]:
        if self._ctx is None:
            self._open()
        out = np.empty((len(inputs), self.width), dtype=np.float32)
        i = 0
        while i < len(inputs):
            # As many whole inputs as fit one micro-batch and the sequence limit.
            group = [i]
            used = len(inputs[i])
            while (len(group) < MAX_SEQS and i + len(group) < len(inputs)
                   and used + len(inputs[i + len(group)]) <= self._n_ctx):
                used += len(inputs[i + len(group)])
                group.append(i + len(group))
            self._run([inputs[k] for k in group], out[i : i + len(group)])
            i += len(group)
        if self._normalize:
            norms = np.linalg.norm(out, axis=1, keepdims=True)
            out /= np.maximum(norms, 1e-12)
        return out

    def _run(self, seqs: list[list[int]], into: npt.NDArray[np.float32]) -> None:
        lc.llama_memory_clear(lc.llama_get_memory(self._ctx), True)
        b = self._batch
        n = 0
        for seq, ids in enumerate(seqs):
            for pos, tok in enumerate(ids):
                b.token[n] = tok
                b.pos[n] = pos
                b.n_seq_id[n] = 1
                b.seq_id[n][0] = seq
                b.logits[n] = True
                n += 1
        b.n_tokens = n
        rc = lc.llama_decode(self._ctx, b)
        if rc != 0:
            raise EngineFailure(f"llama.cpp could not embed: llama_decode returned {rc}")
        for seq in range(len(seqs)):
            ptr = lc.llama_get_embeddings_seq(self._ctx, seq)
            if not ptr:
                raise EngineFailure("llama.cpp returned no pooled embedding")
            into[seq] = np.ctypeslib.as_array(ptr, shape=(self.width,))

    def close(self) -> None:
        if self._ctx is not None:
            lc.llama_batch_free(self._batch)
            lc.llama_free(self._ctx)
            self._ctx = None
