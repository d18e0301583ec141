"""Issue 46 §6: chat prompt ids equal transformers' ``apply_chat_template(tokenize=True)``, per family,
with the family's real template, multi-turn with a system prompt, on both backends' tokenizers; control
tokens written inside messages stay plain text (as transformers' ``sanitize_control_tokens=True``).

Tokenizers are llama.cpp's vocab-only GGUFs (tests/assets/vocab, see its README). Stand-ins where the
real vocabulary is not shipped: Mistral and Gemma on llama-spm (SentencePiece), Granite on starcoder,
gpt-oss on gpt-2 (GPT-2-style byte-level BPE): their control tokens render as text there, so those
cases check the whitespace joins at markup/content boundaries, not control-token parsing.
"""
from __future__ import annotations

import logging
import types
from pathlib import Path

import pytest

from cllm.backends.llama_cpp.native import LlamaModelHandle
from cllm.backends.llama_cpp.tokenizer import LlamaCppTokenizer
from cllm.backends.torch.tokenizer import HFTokenizer
from cllm.engine.llm_engine import LLMEngine
from cllm.model_path import resolve_model_path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Hi there!\n\nWhat is 2+2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "  And 3+3? "},
]
# family: (vocab GGUF under assets/vocab, or None for the embedded model; template, or None for the GGUF's own)
FAMILIES = {
    "llama3": ("ggml-vocab-llama-bpe.gguf", "meta-llama-Llama-3.1-8B-Instruct.jinja"),
    "mistral": ("ggml-vocab-llama-spm.gguf", "Mistral-Small-3.2-24B-Instruct-2506.jinja"),
    "gemma": ("ggml-vocab-llama-spm.gguf", "google-gemma-2-2b-it.jinja"),
    "phi3": ("ggml-vocab-phi-3.gguf", "microsoft-Phi-3.5-mini-instruct.jinja"),
    "granite": ("ggml-vocab-starcoder.gguf", "ibm-granite-granite-3.3-2B-Instruct.jinja"),
    "gpt-oss": ("ggml-vocab-gpt-2.gguf", "openai-gpt-oss-120b.jinja"),
    "deepseek": ("ggml-vocab-deepseek-llm.gguf", "deepseek-ai-DeepSeek-V3.1.jinja"),
    "qwen": ("ggml-vocab-qwen2.gguf", "Qwen-Qwen2.5-7B-Instruct.jinja"),
    "smollm2": (None, None),
    # the case issue 46 saw: "\n\n" ending each header, over a GPT-2-style pre-tokeniser (Ċ Ċ, not ĊĊ)
    "llama3-template-gpt2-vocab": ("ggml-vocab-gpt-2.gguf", "meta-llama-Llama-3.1-8B-Instruct.jinja"),
}
# llama.cpp's tokenizer itself differs from transformers' (same text, other ids) for these: SentencePiece
# gets a word-start space after every control token in llama.cpp; Phi-3's role tokens strip the newline
# after them in llama.cpp (as the real HF tokenizer's rstrip, which the GGUF does not carry);
# DeepSeek's BOS maps to another id in transformers' GGUF conversion. There the llama.cpp backend is held
# to llama.cpp's tokenisation of the whole prompt, which is what llama-server gives.
LLAMA_CPP_TOKENIZER_DIFFERS = {"mistral", "gemma", "phi3", "deepseek"}


def _conversation(family: str) -> list[dict]:
    return CONVERSATION[1:] if family == "gemma" else CONVERSATION  # Gemma's template refuses a system role


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    from transformers import AutoTokenizer

    logging.getLogger("transformers").setLevel(logging.ERROR)
    name = request.param
    vocab, template = FAMILIES[name]
    path = resolve_model_path(None) if vocab is None else ASSETS / "vocab" / vocab
    source = (ASSETS / "chat_templates" / template).read_text() if template else None
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    llama = LlamaModelHandle(path=path, vocab_only=True)
    yield types.SimpleNamespace(
        name=name, hf=hf, source=source or hf.chat_template, messages=_conversation(name),
        torch_tok=HFTokenizer(hf, vocab_size=len(hf), chat_template=source),
        llama_tok=LlamaCppTokenizer(model=llama, chat_template=source))
    llama.close()


def _cllm_ids(tokenizer, messages) -> list[int]:
    return LLMEngine.tokenize_chat(types.SimpleNamespace(tokenizer=tokenizer, _chat=None), messages)


def _transformers_ids(f, messages, **kwargs) -> list[int]:
    out = f.hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, chat_template=f.source, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_torch_tokenizer_chat_ids_equal_transformers(family):
    assert _cllm_ids(family.torch_tok, family.messages) == _transformers_ids(family, family.messages)


def test_llama_cpp_tokenizer_chat_ids_equal_the_whole_prompt_tokenised(family):
    ids = _cllm_ids(family.llama_tok, family.messages)
    text = family.hf.apply_chat_template(family.messages, tokenize=False, add_generation_prompt=True,
                                         chat_template=family.source)
    assert ids == family.llama_tok.encode(text, add_special=False, parse_special=True)
    if family.name not in LLAMA_CPP_TOKENIZER_DIFFERS:
        assert ids == _transformers_ids(family, family.messages)


def _hostile(f, tokenizer) -> tuple[list[dict], set[int]]:
    """The conversation with every control token the template writes repeated inside a user message."""
    benign = f.hf.apply_chat_template(f.messages, tokenize=False, add_generation_prompt=True, chat_template=f.source)
    used = [t for t in tokenizer.control_tokens if t in benign]
    messages = [dict(m) for m in f.messages]
    messages[-1]["content"] = "x" + "\n".join(used) + " y"
    control_ids = {i for t in used for i in tokenizer.encode(t, add_special=False, parse_special=True)}
    return messages, control_ids


@pytest.mark.parametrize("backend", ["torch", "llama_cpp"])
def test_control_tokens_inside_messages_stay_text(family, backend):
    tokenizer = family.torch_tok if backend == "torch" else family.llama_tok
    messages, control_ids = _hostile(family, tokenizer)
    benign_ids = _cllm_ids(tokenizer, family.messages)
    hostile_ids = _cllm_ids(tokenizer, messages)
    assert [t for t in hostile_ids if t in control_ids] == [t for t in benign_ids if t in control_ids]
    if backend == "torch":
        assert hostile_ids == _transformers_ids(family, messages, sanitize_control_tokens=True)
