"""A draft model cut from the target itself: its first ``layers`` transformer blocks, the same embeddings,
final norm, LM head and tokenizer, written as a GGUF with the ``gguf`` package (tensors copied as they
are, no requantising).

No smaller model with the embedded model's vocabulary can be downloaded here, so this is the draft model
the tests and ``benchmarks/draft_truncated.py`` can build: a real second model whose greedy tokens agree
with the target's only part of the time (an early exit that was never trained to exit: 5-35 % top-1
agreement on the embedded model for 4-24 of its 30 layers), so its drafts are partly accepted and partly
rejected, which is what the draft-model path must get right.
"""
from __future__ import annotations

from pathlib import Path


def write_layer_draft(source: Path, dest: Path, layers: int) -> Path:
    """Write the first ``layers`` blocks of the GGUF model ``source`` (a block-structured architecture
    such as llama) to ``dest``; ValueError if ``layers`` is not between 1 and the model's block count."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    count_key = f"{arch}.block_count"
    if count_key not in reader.fields:
        raise ValueError(f"{source} has no {count_key}: not a block-structured model")
    total = reader.fields[count_key].contents()
    if not 1 <= layers <= total:
        raise ValueError(f"layers={layers}: the model has {total} blocks, keep between 1 and {total}")
    writer = gguf.GGUFWriter(str(dest), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # written by the writer itself
        if field.name == count_key:
            writer.add_uint32(count_key, layers)
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and int(tensor.name.split(".")[1]) >= layers:
            continue
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest
