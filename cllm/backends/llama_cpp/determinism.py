"""How the llama.cpp backend keeps ``model.deterministic``: which of ggml's CPU paths make a row's result
depend on its batch, and the settings that avoid them.

Found in ggml-cpu (llama-cpp-python 0.3.36) and measured on the embedded model, one sequence's 300-token
prompt and 40 greedy steps compared bitwise: whole prompt alone, in chunks of 16, beside 7 other
sequences (one of 700 tokens), decoding in 2-row steps (a token and a throwaway draft, as a
verification), with 1 and 2 threads (``benchmarks/determinism.py --paths``):

- **Flash attention with an f16 or f32 KV cache**: ggml takes a *tiled* kernel when a sequence brings at
  least a tile of query rows (a prompt chunk) and, for a lone sequence decoding one row over 512 or more
  KV cells, a *split-KV* kernel whose split follows the thread count. Both sum in another order than the
  row-by-row kernel: 41 of 41 steps differed chunked, 40 of 41 batched, in 2-row steps or with one
  thread. With any other cache type (bf16, q8_0, ...) ggml keeps its row-by-row kernel, which walks one
  sequence's cells in order and skips the masked ones: 0 of 41 differed, in every case.
- **No flash attention**: attention is two matmuls per sequence (split cache); a sequence bringing two or
  more rows takes llamafile's tiled f16 GEMM where one row takes the vector kernel: 40 of 41 steps
  differed in 2-row steps (chunks, batch-mates and threads did not matter here).
- **Matmuls**: each output element is one dot product whatever the batch (ggml splits rows and columns
  between threads, never a reduction): Q4_1 (vector kernel only on x86), Q8_0 (llamafile's tiled GEMM
  for two or more columns, the vector kernel for one) and Q4_0 (repacked 8x8 kernels) gave identical
  rows in every case on the AVX-512 EPYC: those kernels accumulate each 32-weight block's scaled
  int8 dot product into 8 float lanes in the same order. RMSNorm, RoPE and the rest are per row.
- **Pooled embeddings**: mean pooling is a matmul over every token of the decode, so an input's vector
  depends on where it sits among the others: under the setting each input is embedded by a decode of
  its own (with flash attention and a bf16 cache as well).
- **GPU layers**: llama.cpp's CUDA/Metal kernels choose by batch size (MMQ, MMVQ, cuBLAS): not promised.
"""
from __future__ import annotations

from cllm.backends.determinism import OFF, Determinism

# KV cache types for which ggml's CPU flash attention takes batch-dependent (tiled, split-KV) paths.
BATCH_DEPENDENT_KV = frozenset({"f16", "f32"})
DETERMINISTIC_KV = "bf16"  # f16's range, 8 bits of mantissa (f16 has 11): what the setting uses in their place


def kv_type(name: str, *, deterministic: bool) -> str:
    """The KV cache type llama.cpp gets: under the setting, bf16 in place of f16 or f32."""
    return DETERMINISTIC_KV if deterministic and name in BATCH_DEPENDENT_KV else name


def report(*, deterministic: bool, type_k: str, type_v: str, gpu_layers: int) -> Determinism:
    """What the setting changed and what it cannot promise on this backend."""
    if not deterministic:
        return OFF
    how = ["flash attention on (row-by-row kernel)", f"KV cache {type_k}/{type_v}",
           "one embedding input per decode", "thread count free (no reduction is split between threads)"]
    not_promised = (f"{gpu_layers if gpu_layers > 0 else 'all'} layers on a GPU: llama.cpp's GPU kernels "
                    f"choose by batch size (set n_gpu_layers: 0 for the promise)",) if gpu_layers else ()
    return Determinism(on=True, how=tuple(how), not_promised=not_promised)
