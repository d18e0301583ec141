"""The torch backend's KV export/import for a hand-off moves all of a sequence's blocks in one
gather and one copy each way (issue 27 item 10), in the same per-block wire format as before."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

import cllm
from tests.integration.test_kv_handoff import (  # noqa: F401 (tiny_llama: a fixture)
    TORCH_SETTINGS, evaluated_tokens, missing_tokens, steps, tiny_llama,
)
from tests.unit.fakes import run_all


@contextlib.contextmanager
def counting_copies() -> Iterator[dict[str, int]]:
    """Counts Tensor.cpu() and Tensor.to() calls (host <-> device copies on a GPU; each one a sync)."""
    counts = {"cpu": 0, "to": 0}
    cpu, to = torch.Tensor.cpu, torch.Tensor.to

    def counted_cpu(self, *args, **kwargs):
        counts["cpu"] += 1
        return cpu(self, *args, **kwargs)

    def counted_to(self, *args, **kwargs):
        counts["to"] += 1
        return to(self, *args, **kwargs)
    torch.Tensor.cpu, torch.Tensor.to = counted_cpu, counted_to
    try:
        yield counts
    finally:
        torch.Tensor.cpu, torch.Tensor.to = cpu, to


def test_export_and_import_copy_every_block_at_once(tiny_llama):  # noqa: F811
    params = cllm.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompt = [5, 17, 42, 99, 7, 250, 31]
    with cllm.LLM(model=tiny_llama, **TORCH_SETTINGS) as ref:
        ref.engine.add_request(prompt, params, request_id="h")
        expected = run_all(ref.engine)["h"].outputs[0].token_ids
    with cllm.LLM(model=tiny_llama, **TORCH_SETTINGS) as a, cllm.LLM(model=tiny_llama, **TORCH_SETTINGS) as b:
        a.engine.add_request(prompt, params, request_id="h")
        steps(a.engine, 8)
        src = a.engine.backend
        seq = src.blocks.sequence("h")
        n_blocks = -(-seq.num_computed // src.blocks.block_size)
        assert n_blocks >= 3
        wire = [torch.stack(src.kv.block(block)).cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
                for block in seq.block_ids[:n_blocks]]  # one segment per block: [2, layers, *block]
        with counting_copies() as exporting:
            segments = src.export_kv("h")
        assert segments[1:] == wire  # the format other replicas expect, unchanged
        assert exporting["cpu"] + exporting["to"] <= 1, exporting  # not one copy per block
        snapshot, moved = a.engine.export_request("h")
        dst = b.engine.backend
        imports = []
        import_kv = dst.import_kv

        def counted_import(*args):
            with counting_copies() as copies:
                ok = import_kv(*args)
            imports.append({**copies, "ok": ok})
            return ok
        dst.import_kv = counted_import
        b.engine.import_request(snapshot, moved)
        with evaluated_tokens(b.engine) as evaluated:
            out = run_all(b.engine)["h"].outputs[0]
        assert out.token_ids == expected  # the imported KV is the exported KV
        assert len(imports) == 1 and imports[0]["ok"] and imports[0]["cpu"] + imports[0]["to"] <= 2, imports
        # Only what the KV lacked was evaluated (a failed import would recompute all, with the same output).
        assert evaluated == [missing_tokens(len(prompt), len(expected), snapshot.num_computed_tokens)]


def test_gather_and_scatter_match_the_per_block_layout_in_both_pool_layouts():
    """Head-major pools (CPU, flex) and token-major ones (flash on CUDA): a batched gather gives each
    block as ``torch.stack(kv.block(id))`` did, and a scatter writes it back to the same place."""
    import types

    from cllm.backends.torch.backend import TorchBackend
    from cllm.backends.torch.kv_cache import KVCacheShape, PagedKVCache

    for head_major in (True, False):
        shape = KVCacheShape(num_layers=2, num_blocks=9, block_size=4, num_kv_heads=3, head_dim=5)
        src = PagedKVCache(shape, dtype=torch.float32, device=torch.device("cpu"), head_major=head_major)
        src.k.normal_()
        src.v.normal_()
        fake_src = types.SimpleNamespace(kv=src, _block_dim=lambda hm=head_major: 2 if hm else 1)
        ids = [7, 2, 5]
        blocks = TorchBackend._gather_blocks(fake_src, ids)
        for i, block in enumerate(ids):
            assert torch.equal(blocks[i], torch.stack(src.block(block)))
        dst = PagedKVCache(shape, dtype=torch.float32, device=torch.device("cpu"), head_major=head_major)
        fake_dst = types.SimpleNamespace(kv=dst, _block_dim=fake_src._block_dim)
        TorchBackend._scatter_blocks(fake_dst, [1, 8, 3], blocks)
        for block, there in zip(ids, [1, 8, 3]):
            assert torch.equal(torch.stack(dst.block(there)), torch.stack(src.block(block)))
        untouched = [b for b in range(9) if b not in (1, 8, 3)]
        assert all(not torch.stack(dst.block(b)).any() for b in untouched)
