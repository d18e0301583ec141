"""model.deterministic on the llama.cpp backend, on the embedded model: one request's tokens and every
logprob bitwise the same alone, beside 15 random others, after prefix-cache hits of several lengths,
prefilled in chunks of 16 or whole, with speculation on or off, streamed or not; the same cases with the
setting off show today's behaviour (agreement within rounding only). docs/reproducibility.md."""
from __future__ import annotations

import numpy as np
import pytest

import cllm
from tests.integration.determinism_cases import PARAMS, assert_agree_within_rounding, cases, reference
from tests.integration.test_llama_cpp_engine import LOGPROB_TOL

BASE = dict(n_threads=2, n_seq_max=16, slot_prompt_similarity=0.0)
CHUNKED = dict(n_batch=16, n_ubatch=16, max_prefill_chunk=16)


def test_deterministic_results_are_bitwise_the_same_whatever_the_batch_chunking_cache_or_speculation():
    got = cases(deterministic=True, base=BASE, chunked=CHUNKED)
    differing = {name: t.differences(got[reference(name)]) for name, t in got.items()}
    assert not any(differing.values()), f"steps differing from alone (of {PARAMS.max_tokens}): {differing}"


def test_without_the_setting_results_agree_within_rounding_only():
    """Today's behaviour, kept visible: the same cases agree within LOGPROB_TOL (the first near-tie may
    part them); how many steps differ bitwise is printed, not asserted (it follows the machine's kernels)."""
    assert_agree_within_rounding(cases(deterministic=False, base=BASE, chunked=CHUNKED), tol=LOGPROB_TOL,
                                 tie=2 * LOGPROB_TOL)


@pytest.mark.parametrize("deterministic", [True, False])
def test_identical_embedding_inputs_get_identical_vectors_wherever_they_sit(deterministic):
    text = "The quick brown fox jumps over the lazy dog."
    fillers = ["a", "Embeddings of several inputs are computed together in one decode call.", "x y z " * 20]
    inputs = [text, fillers[0], text, fillers[1], text, text, fillers[2], text, fillers[0], text, text, text]
    with cllm.LLM(deterministic=deterministic, n_threads=2) as llm:
        vectors = np.array([e.embedding for e, i in zip(llm.embed(inputs), inputs) if i == text], dtype=np.float32)
        alone = np.array(llm.embed([text])[0].embedding, dtype=np.float32)
    assert len(vectors) == 8
    if deterministic:
        assert (vectors == alone).all(), f"max difference {np.abs(vectors - alone).max():.3g}"
    else:  # within rounding only (EMBED_BATCH_TOL of the embeddings tests)
        assert np.abs(vectors - alone).max() <= 5e-3
