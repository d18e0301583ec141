"""Process-wide test set-up."""
from __future__ import annotations

import contextlib

# Tests build llama-cpp-python `Llama` objects directly (reference logits); on a CPU with AMX they need
# the same workaround as cllm's own backend (see avoid_amx_extra_buffers), applied before any of them loads.
with contextlib.suppress(ImportError):
    import cllm.backends.llama_cpp.native  # noqa: F401 - applies avoid_amx_extra_buffers()
