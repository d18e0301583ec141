"""Configuration: one pydantic model per concern, merged from four layers.

Precedence, lowest first: the defaults below (documented in config.yaml), a
YAML file, ``CLLM_<NAME>`` environment variables, keyword arguments / CLI
flags. Every setting has a name unique across sections, so overrides are flat
(``n_ctx=4096``, ``CLLM_N_CTX=4096``, ``--n-ctx 4096``) while the YAML file
is grouped by section.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


KvCacheType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class ModelConfig(_Section):
    """Which model, on which backend, with how much KV room."""

    model: str | None = Field(None, description="GGUF file or HF model directory; None = embedded SmolLM2-135M-Instruct Q4_1")
    backend: str = Field("llama_cpp", description="registered backend name (see `cllm backends`)")
    n_ctx: int | None = Field(None, ge=64, le=1 << 22, description="KV cache size in tokens for all sequences together; llama_cpp gives each sequence n_ctx/n_seq_max of it (unless kv_unified), capped by the model's trained context; None = chosen at run time: llama_cpp n_seq_max x 2048 (cllm/backends/llama_cpp/sizing.py), torch 16384")
    n_seq_max: int | None = Field(None, ge=1, le=256, description="sequences that can hold KV at once (llama.cpp seq_id pool size); None = chosen at run time: llama_cpp as many 2048-token sequences as fit in 1/8 of the available memory, at most 64 (cllm/backends/llama_cpp/sizing.py), torch 8")
    n_threads: int | None = Field(None, ge=1, le=1024, description="CPU threads for inference; None = chosen at run time: llama_cpp uses one per physical core this process may run on (SMT siblings once, as llama.cpp's own default), at most what a cgroup CPU quota pays for (rounded down), fewer while other processes take the CPU (llama_cpp.adapt_threads); torch all usable cores")
    n_batch: int = Field(2048, ge=1, le=1 << 16, description="most tokens evaluated in one forward call (llama.cpp splits it into n_ubatch micro-batches); 2048 as llama-server, so a burst of prompts is prefilled in one step while nobody decodes")
    seed: int = Field(0, description="default sampling seed for requests that give none")
    deterministic: bool = Field(False, description="batch-invariant inference: a request's greedy tokens and every logprob bitwise identical whatever else is batched with it, however its prompt is chunked or found in the prefix cache, with speculation on or off, streamed or not (and so seeded sampling too); embeddings identical wherever an input sits. llama_cpp: flash attention on, a bf16 KV cache in place of f16/f32 (ggml's row-independent attention path), one embedding input per decode; torch: fixed-shape matmuls and a fixed-split attention on CPU. What a backend or device cannot promise is said at start-up (docs/reproducibility.md)")
    chat_template: str | None = Field(None, description="a Jinja chat template used in place of the model's own: the path of a template file, or the template itself (vLLM's and llama-server's --chat-template); None = the model's (GGUF tokenizer.chat_template, or the HF directory's)")


class LlamaCppConfig(_Section):
    """llama.cpp-only knobs."""

    n_ubatch: int = Field(512, ge=1, le=1 << 16, description="physical micro-batch size inside llama_decode")
    weights: Literal["auto", "file", "q8_0", "f16"] = Field("auto", description="which weights llama.cpp runs: file = the model file as it is (llama-server's numerics); q8_0 / f16 = a copy converted once by llama.cpp's quantizer and cached under ~/.cache/cllm/weights; auto = q8_0 for a Q4_1 file whose Q8_0 copy is at most 256 MiB, on an AVX2 CPU with no GPU layers (llama.cpp has no batched Q4_1 kernel on x86: measured 1.6-1.75x at 16-64 sequences, 0.98x at one), else file (cllm/backends/llama_cpp/weights.py)")
    flash_attn: bool | Literal["auto"] = Field("auto", description="llama.cpp's flash attention kernels: auto = on a CPU, serving steps (decodes of 1 and 16 sequences at short and long contexts, a verification, a prefill chunk) timed once on this machine with and without them, the verdict cached: on unless the geometric mean of the time ratios says >5 % slower (measured on an AVX-512/BF16 EPYC: 0.80x, on; an AVX-512/AMX Xeon's earlier step timings give ~1.4x, off); on a GPU llama.cpp's own auto (on where supported); true = required, false = off")
    prefix_cache: bool = Field(True, description="keep finished sequences' KV in idle slots for prefix reuse")
    prompt_cache_mib: int | None = Field(None, ge=0, description="host memory (MiB) for the KV of sequences evicted from their slots, loaded back when a later prompt starts with them (llama-server's --cache-ram); the server's engine copies idle slots there while it has nothing to do, so an eviction seldom waits for the copy; null = 1/8 of the memory available at start-up, at most 8192 (llama-server's default); 0 = off")
    slot_prompt_similarity: float = Field(0.5, ge=0.0, le=1.0, description="a cached prefix is reused only when it covers at least this fraction of the new prompt (as llama-server's --slot-prompt-similarity); otherwise the request takes an empty slot, else the least recently used one, so a shared BOS or chat header never evicts a long cached conversation")
    kv_unified: bool = Field(False, description="false = n_ctx/n_seq_max KV cells per sequence (no sequence attends to another's cells), as llama-server; true = one pool shared by all sequences (one may use all of n_ctx). Either way batch composition can change logits by float rounding (docs/reproducibility.md)")
    n_gpu_layers: int | None = Field(None, ge=-1, description="model layers offloaded to the GPU; None = all when the installed llama-cpp-python has a GPU backend (llama_supports_gpu_offload), else 0; -1 = all")
    type_k: KvCacheType = Field("f16", description="KV cache element type of keys (llama-server --cache-type-k): f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1")
    type_v: KvCacheType = Field("f16", description="KV cache element type of values; a quantized type (q*/iq*) needs flash_attn: true")
    offload_kqv: bool = Field(True, description="keep the KV cache and attention on the GPU with the offloaded layers (false: in host memory)")
    mmproj: str | None = Field(None, description="the vision projector GGUF that makes the model take images (llama-server's --mmproj; llama.cpp's convert_hf_to_gguf.py --mmproj writes one); null = looked for beside the model file: mmproj-<model stem>.gguf, <model stem>-mmproj.gguf or <model stem>.mmproj.gguf, else the folder's only mmproj*.gguf; 'none' = text only")
    adapt_threads: Literal["auto", "off"] = Field("auto", description="auto = while other processes take CPU time, decode with fewer threads than model.n_threads' default and come back up when they stop (ggml's threads spin-wait for each other, so one thread the OS takes away stalls every step; step times are measured per thread count: cllm/backends/llama_cpp/thread_governor.py); only when n_threads is left unset and no layer is on a GPU; off = always the default count")

    @model_validator(mode="after")
    def _quantized_v_needs_flash(self) -> LlamaCppConfig:
        # llama.cpp refuses a quantized V cache without flash attention (its non-FA path transposes V).
        if self.type_v not in ("f32", "f16", "bf16") and self.flash_attn is False:
            raise ValueError(f"type_v={self.type_v!r} (a quantized V cache) needs flash_attn: true or auto in llama.cpp")
        return self


class TorchConfig(_Section):
    """torch-backend-only knobs."""

    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="auto = bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16 or AMX), else float32 (with float16 linear weights: see linear_weights)")
    moe_dense_decode: Literal["auto", "on", "off"] = Field("auto", description="CPU, native MoE (Qwen3-MoE, Mixtral): also keep every sparse layer's experts concatenated, a second copy of the expert weights, and run batches that reach most experts as two GEMMs over all of them instead of a matmul per expert (up to the batch size at which that was faster when timed at load); auto = on when the copy takes at most 1/8 of the host's memory")
    linear_weights: Literal["auto", "dtype", "float16"] = Field("auto", description="how the linear layers' weights are stored under float32 compute on CPU: dtype = float32; float16 = half the bytes through fbgemm's fp16 GEMM (activations and accumulation stay float32; each weight rounded to float16); auto = float16 when dtype is auto and resolves to float32 on CPU (no native bf16, e.g. AVX2-only) and fbgemm runs here, else dtype")
    model_impl: Literal["auto", "native", "transformers"] = Field("auto", description="which model code runs (as vLLM's --model-impl): native = cllm's own batched decoder (Llama, Mistral, Qwen2, Qwen3 and their MoE kin Qwen3-MoE and Mixtral); transformers = transformers' own model code with cllm's paged attention plugged in through its attention interface (any decoder transformers has: Gemma, Phi, OLMo, Granite, gpt-oss, DeepSeek, ...); auto = native where there is one, else transformers")
    block_size: int = Field(16, ge=1, le=1024, description="tokens per paged KV block")
    torch_compile: bool = Field(False, description="wrap the model forward in torch.compile")
    attention: Literal["auto", "sdpa", "flex", "flash"] = Field("auto", description="attention kernel: auto = flash (flash_attn installed, block_size % 256 == 0) else flex on CUDA, sdpa on CPU; flex = FlexAttention over the paged pool (compiled on CUDA, and on CPU with torch_compile); sdpa = gathered blocks + SDPA/matmul")
    sampler: Literal["auto", "torch", "numpy"] = Field("auto", description="where the torch backend's logits are sampled: torch = on the device (only chosen ids and asked-for logprobs reach the host), numpy = copied to the host; auto = torch on CUDA, numpy on CPU")
    cuda_graphs: bool = Field(True, description="CUDA: capture pure decode steps as CUDA graphs, one per batch-size bucket (1, 2, 4, then multiples of 8), padded up; needs attention flex; ignored on CPU")
    cuda_graph_max_batch: int = Field(256, ge=1, le=4096, description="CUDA: largest captured decode batch (capped at the sequence cap; 32 rows more are captured for short prompt tails beside it); larger steps run eagerly")
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0, description="CUDA: share of the device's memory cllm may use (weights + activations + KV); the KV pool gets what is left of it after the weights load, as vLLM (n_ctx then only caps max_model_len)")
    gpu_n_seq_max: int | None = Field(256, ge=1, le=4096, description="CUDA: sequences that can hold KV at once (model.n_seq_max is CPU-sized); null = n_seq_max")
    gpu_n_batch: int | None = Field(8192, ge=1, le=1 << 20, description="CUDA: most tokens in one forward call (model.n_batch is CPU-sized); null = n_batch")


class EmbeddingConfig(_Section):
    """/v1/embeddings and LLM.embed."""

    embedding_pooling: Literal["auto", "mean", "cls", "last"] = Field("auto", description="how token hidden states become one vector; auto = the GGUF's <arch>.pooling_type when it names mean/cls/last, else mean (what llama-server does for a decoder model without pooling metadata); torch: auto = mean")
    embedding_batch_tokens: int = Field(1024, ge=16, le=1 << 16, description="tokens evaluated in one embedding forward (inputs of concurrent requests are packed together up to this); also the longest input allowed")
    embedding_max_inputs: int = Field(16, ge=1, le=256, description="inputs packed into one embedding forward (llama.cpp: n_seq_max of the embeddings context)")


class SchedulerConfig(_Section):
    """Continuous-batching policy."""

    max_num_seqs: int | None = Field(None, ge=1, le=4096, description="running sequences cap; None = backend's n_seq_max")
    max_num_batched_tokens: int | None = Field(None, ge=1, le=1 << 20, description="token budget per step; None = n_batch")
    max_prefill_chunk: int | None = Field(None, ge=1, le=1 << 20, description="most prompt tokens one step carries while any sequence is decoding, so a decode waits at most this much prefill; with nobody decoding a step may fill the whole token budget with prompts (as llama-server fills n_batch); None = the whole token budget (decodes first, prompts fill the rest), as llama-server and vLLM")
    max_decode_stall_ms: float | Literal["auto", "off"] | None = Field("auto", description="while sequences decode, a step's prompt tokens are cut so that the step should take at most this long, from the seconds per batched token measured on this machine (at least 16 prompt tokens a step, so prompts always progress); auto = decode_stall_factor times the measured time of a decode step of as many sequences, so a long prompt arriving beside running streams is prefilled over several steps instead of stalling them for its whole prefill (~1.5 s per 1,000 tokens on 2 CPU cores); on a GPU (torch on CUDA, llama.cpp with offloaded layers) auto is no bound, since it cost 5-10 % of the server's throughput there; off (or null) = no time bound (max_prefill_chunk alone)")
    decode_stall_factor: float = Field(3.0, ge=1.0, le=1000.0, description="with max_decode_stall_ms: auto, how many times longer than a decode step of the same sequences a step carrying prompt tokens may take")
    min_prefill_per_prompt: int = Field(512, ge=1, le=1 << 20, description="with max_decode_stall_ms: auto, the fewest prompt tokens a step carries beside decodes, per prompt waiting or being prefilled (up to max_prefill_chunk): one long prompt beside running streams is spread over several steps, a queue of them gets more of each step, since every queued prompt is a request waiting on prefill (smaller chunks also cost more per token: under 128 tokens 1.7x)")
    policy: Literal["fcfs", "priority"] = Field("fcfs", description="waiting-queue order: arrival, or priority (lower value first) then arrival")
    preemption_mode: Literal["recompute", "swap"] = Field("recompute", description="how a preempted sequence resumes: re-evaluate its tokens, or restore saved KV (backends that support it)")
    max_waiting: int = Field(1024, ge=0, le=1 << 20, description="waiting-queue bound; beyond it new requests are refused (HTTP 429)")
    request_timeout_s: float | None = Field(None, gt=0, description="per-request deadline in seconds, from arrival; None = none")
    lookahead: Literal["auto", "on", "off"] = Field("auto", description="one-step lookahead: launch the next decode step on the device-sampled ids before the host reads them, so the host's bookkeeping, outputs and next schedule run beside the device's forward instead of after it (docs/gpu.md); auto = on where the forward runs asynchronously and the backend samples on its device (torch on CUDA), off otherwise; on = wherever the backend can (the torch backend with torch.sampler: torch on CPU runs the same code path, for tests); never with speculative decoding, whose steps keep today's order")
    max_stop_string_chars: int = Field(256, ge=1, le=1 << 16, description="longest stop string a request may give (stop matching scans this much text per token)")

    @field_validator("lookahead", mode="before")
    @classmethod
    def _on_off(cls, value: object) -> object:
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value  # (YAML's bare on/off)

    @field_validator("max_decode_stall_ms", mode="before")
    @classmethod
    def _positive_stall(cls, value: object) -> object:
        if value is False or value == "off":  # (YAML and --set read a bare off as false)
            return None
        if isinstance(value, bool) or (isinstance(value, (int, float)) and not 0 < value <= 1e6):
            raise ValueError(f"max_decode_stall_ms={value!r}: give milliseconds in (0, 1e6], 'auto' or 'off'")
        return value


class ServerConfig(_Section):
    """`cllm serve` settings."""

    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(8000, ge=0, le=65535, description="bind port")
    api_key: str | None = Field(None, description="if set, every route but /health requires `Authorization: Bearer <key>`; an empty key is an error, not 'no auth'")
    allowed_hosts: list[str] = Field(default_factory=list, description="without an api_key, Host headers served besides loopback names (DNS-rebinding defence); [\"*\"] = any")
    cors_origins: list[str] = Field(default_factory=list, description="allowed CORS origins; empty = CORS off")
    served_model_name: list[str] | None = Field(None, description="model id(s) the server answers to and /v1/models lists (a string or a list of aliases; the first is the name responses carry); None = file stem")
    accept_any_model: bool = Field(False, description="accept requests naming any model (llama-cpp-python's behaviour); false = an unknown model name is a 404 model_not_found")
    max_tokens_limit: int = Field(4096, ge=1, description="largest max_tokens a request may ask for")
    max_n: int = Field(8, ge=1, le=128, description="largest n a request may ask for")
    max_body_bytes: int | None = Field(None, ge=1024, description="largest request body; null = auto: 1 MiB while no loaded model takes images, 32 MiB while one does (photos arrive inline as base64)")
    max_body_bytes_in_flight: int = Field(256 << 20, ge=1024, description="request bodies all connections together may hold while they are received and served; a body that would pass it gets 503 with Retry-After, so many large uploads at once cannot take the host's memory")
    max_sequences_per_request: int = Field(64, ge=1, le=1 << 16, description="most sequences (prompts x n) one request may queue; more is a 400, so one request cannot fill the waiting queue")
    max_sequences_per_client: int | None = Field(256, ge=1, description="most sequences one client (remote address) may have queued or running at once; beyond it 429 with Retry-After, so one client cannot fill max_waiting; None = no cap")
    max_compiles_per_client: int | None = Field(2, ge=1, description="cold grammar compiles (a new json_schema, grammar, regex or forced tool call) one client (remote address) may have running at once; beyond it 429 with Retry-After, so one client cannot occupy the compiler; None = no cap")
    allow_client_priority: bool = Field(False, description="honour a request's `priority` field (with policy: priority); when false a non-zero priority is a 400, so clients cannot jump the queue")
    keep_alive_timeout_s: float = Field(5.0, gt=0, description="close an idle keep-alive connection after this long")
    header_read_timeout_s: float = Field(10.0, gt=0, description="close a connection whose request line and headers take longer than this to arrive (slowloris)")
    body_read_timeout_s: float = Field(30.0, gt=0, description="a request body that takes longer than this to arrive gets 408")
    max_header_bytes: int = Field(16384, ge=1024, le=1 << 20, description="largest request line + headers; beyond it the connection is refused")
    max_connections: int = Field(512, ge=1, description="open connections (and in-flight requests) at once; beyond it new requests get 503")
    sse_keepalive_s: float = Field(10.0, gt=0, description="while a stream waits (queued, long prefill), send an SSE comment line this often so proxies with read timeouts keep it open")
    stream_stall_timeout_s: float = Field(120.0, gt=0, description="a streamed request whose reader takes nothing for this long while output waits is aborted (its slot and KV freed; the unread output, merged into one pending chunk per prompt, dropped) and its connection reset, freeing its place under max_connections")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log verbosity")
    shutdown_grace_s: float = Field(10.0, ge=0, description="on SIGTERM, how long in-flight requests may finish before being aborted")
    responses_store_size: int = Field(1024, ge=0, le=1 << 20, description="most past /v1/responses results kept in memory (store: true) for previous_response_id and GET/DELETE /v1/responses/{id}; the least recently used goes first; 0 = store nothing")
    responses_store_mib: int = Field(256, ge=1, le=1 << 20, description="most memory (MiB of JSON) the stored responses may take; the least recently used go first")
    responses_store_ttl_s: float = Field(3600.0, gt=0, description="a stored response is forgotten this many seconds after it was stored")
    engine_process: Literal["auto", "on", "off"] = Field("auto", description="run the engine core in a process of its own, so the server's event loop never shares a GIL with it: auto = on for the torch backend on CUDA (few-ms steps, where sharing it cost the server over half its throughput), off otherwise (llama.cpp, CPU: long steps, one copy of the model in one process)")

    core_realtime: Literal["auto", "on", "off"] = Field("auto", description="give the engine core's loop thread real-time priority (SCHED_FIFO 1; threads it starts afterwards stay ordinary), so that on a machine whose cores it shares with the API process and the clients it never waits for a CPU while the device waits for it (cllm/engine/core_priority.py): auto = on where the forward runs on a device (torch on CUDA) and the process may (CAP_SYS_NICE or RLIMIT_RTPRIO), on = wherever the process may (a warning where it may not), off = never; only with engine_process")

    @field_validator("engine_process", "core_realtime", mode="before")
    @classmethod
    def _engine_process_word(cls, value: object) -> object:
        # YAML 1.1 reads on / off as booleans (engine_process: on in config.yaml, --set engine_process=on)
        return ("on" if value else "off") if isinstance(value, bool) else value

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _names_as_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("served_model_name")
    @classmethod
    def _names_valid(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        bad = [v for v in value if not v.strip()]
        if not value or bad:
            raise ValueError(f"served_model_name={value!r}: give non-empty names, or leave it unset (null) for the file stem")
        if len(set(value)) != len(value):
            raise ValueError(f"served_model_name={value!r} repeats a name")
        return value

    @field_validator("api_key")
    @classmethod
    def _key_not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("api_key is empty: set a real key, or leave it unset (null) to run without one")
        return value


class StructuredConfig(_Section):
    """Constrained decoding and tool calling."""

    grammar_cache_size: int = Field(128, ge=1, le=1 << 16, description="compiled grammars (JSON schemas, GBNF, regex, choice lists) kept, least recently used dropped first")
    max_parallel_tool_calls: int = Field(4, ge=1, le=128, description="most calls in one forced reply (tool_choice required with parallel_tool_calls); bounds a small model that would repeat calls until max_tokens")
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral", "generic", "harmony"] = Field("auto", description="how tool calls are read out of the model's text: auto = from the chat template (<|channel|> and <|message|> -> harmony, gpt-oss's commentary to=functions.NAME messages; <tool_call> -> hermes, [TOOL_CALLS] -> mistral, <|python_tag|>/ipython -> llama3_json; a template that does not render tools -> generic, with the tools described in the system message)")
    reasoning_parser: Literal["auto", "none", "deepseek_r1", "qwen3", "glm45", "mistral", "seed_oss", "kimi", "harmony"] = Field("auto", description="how a reasoning model's thinking is split from its answer (reasoning_content in chat, reasoning items in Responses, thinking blocks in Messages): auto = from the chat template (<|channel|> and <|message|> -> harmony, also when the vocabulary has them as control tokens; </think> -> deepseek_r1, [THINK] -> mistral, <seed:think> -> seed_oss, ◁think▷ -> kimi; none of them -> none); none = off (thinking stays in the content; harmony's analysis channel becomes content, its markers still taken out); deepseek_r1 / qwen3 / glm45 = <think>…</think>; harmony = gpt-oss's channels (analysis -> reasoning, final -> content)")
    max_constraint_bytes: int = Field(256 * 1024, ge=1024, le=1 << 26, description="largest json_schema / grammar / regex / choice list a request may send (UTF-8 bytes); larger is a 400 naming the field")
    max_constraint_depth: int = Field(40, ge=2, le=1024, description="deepest JSON nesting of a schema (and () nesting of a grammar or regex); deeper is a 400")
    grammar_compile_timeout_s: float = Field(10.0, gt=0, le=3600, description="budget of one grammar compile, queueing included; past it the request gets a 400 (the compile finishes in the background and is cached)")
    grammar_cache_mib: int = Field(128, ge=1, le=1 << 20, description="compiled grammars kept together (their token masks), MiB; the least recently used go first")


class ImageConfig(_Section):
    """Image inputs: how many, how large, and whether the server may fetch image URLs (cllm.multimodal)."""

    max_images_per_request: int = Field(8, ge=0, le=1024, description="most images one request (all its messages together) may carry; more is a 400; 0 = no images")
    max_image_bytes: int = Field(20 << 20, ge=1024, le=1 << 30, description="largest encoded image (a data: URL's decoded bytes, a fetched body, a file); larger is a 400 naming the part. An image sent inline also counts toward max_body_bytes (auto: 32 MiB while a loaded model takes images)")
    max_image_pixels: int = Field(33_177_600, ge=1, le=1 << 27, description="largest width x height of an image (default 7680x4320, 8K), read from its header before it is decoded (decompression bombs); larger is a 400 naming the part")
    allow_image_urls: bool = Field(False, description="fetch http(s) image URLs in requests; false = only inline images (data: URLs, base64 sources), a URL is a 400 saying how to enable this")
    allow_private_image_urls: bool = Field(False, description="with allow_image_urls, also fetch from private, loopback, link-local and reserved addresses (every address the host resolves to is checked, redirects are re-checked); false keeps the server from being used to reach its own network")
    image_url_timeout_s: float = Field(10.0, gt=0, le=600, description="budget of one image URL fetch (resolving, connecting, redirects and the body together); past it the request gets a 400")
    image_memory_mib: int = Field(1024, ge=1, le=1 << 20, description="decoded images (RGB, 3 bytes a pixel) that the server's requests in flight may hold together; a request whose images would pass it gets 429 with Retry-After, so that a flood of large images is turned away rather than taking the host's memory")


class SpeculativeConfig(_Section):
    """Speculative decoding: several tokens verified per forward pass (cllm.speculative)."""

    speculative: Literal["auto", "off", "ngram", "draft"] = Field("auto", description="how draft tokens are proposed: ngram = from the sequence's own prompt and output (prompt lookup, no second model); draft = a smaller model (speculative_model); off; auto = ngram on llama.cpp (measured never to lose there: 0.98-1.76x at 1-64 clients, docs/speculative.md), off on torch (an H200 lost up to 16 % with no draft accepted). Drafts are verified in the batch's forward pass and accepted so that the output is the target's own (greedy: identical; sampled: the same distribution, the same seeded draws); how many each sequence gets is decided per step from the measured step cost and its acceptance rate, down to none on a busy server. A request may send `speculative: false`")
    speculative_model: str | None = Field(None, description="the draft model of speculative: draft (GGUF file or HF directory for the same backend, with the target's vocabulary)")
    num_speculative_tokens: int = Field(24, ge=1, le=256, description="most draft tokens one sequence verifies in a step")
    speculative_ngram_max: int = Field(4, ge=1, le=16, description="longest n-gram matched (the sequence's last n tokens, found earlier in its prompt or output)")
    speculative_ngram_min: int = Field(2, ge=1, le=16, description="shortest n-gram matched (each match length has its own acceptance record)")

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.speculative_ngram_min > self.speculative_ngram_max:
            raise ValueError(f"speculative_ngram_min={self.speculative_ngram_min} exceeds speculative_ngram_max={self.speculative_ngram_max}")
        if self.speculative == "draft" and not self.speculative_model:
            raise ValueError("speculative=draft needs speculative_model (a smaller model with the same vocabulary)")
        return self


class ClusterConfig(_Section):
    """Scale-out on Ray Serve (`cllm serve --replicas N`, `cllm.serve_ray`) and KV hand-off."""

    replicas: int = Field(1, ge=1, le=1024, description="engine replicas behind one endpoint; more than 1 (or pd) serves through Ray Serve (extra cllm[ray])")
    pd: str | None = Field(None, description="prefill/decode disaggregation as 'prefill=P,decode=D': prompts are prefilled on P replicas, their KV handed to D decode replicas; None = every replica does both")
    handoff_chunk_bytes: int = Field(1 << 20, ge=1024, le=1 << 30, description="KV hand-off chunk size in bytes (a transfer resumes from the last acknowledged chunk)")
    handoff_ttl_s: float = Field(300.0, gt=0, description="a hand-off's KV chunks that no replica took (its client left, its receiver died) are dropped after this many seconds")
    route_block_tokens: int = Field(16, ge=1, le=4096, description="prefix-aware routing hashes prompts in blocks of this many tokens; a request goes to the replica holding its longest hashed prefix")
    route_max_imbalance: int = Field(4, ge=0, le=1 << 20, description="prefix affinity is ignored when the cached replica has more than this many requests beyond the least-loaded one")
    max_ongoing_requests: int = Field(64, ge=1, le=1 << 20, description="requests one replica takes at once (Ray Serve max_ongoing_requests); the rest queue at the router")
    health_check_period_s: float = Field(2.0, gt=0, description="how often Ray Serve checks a replica's engine; a failed check replaces the replica")
    ray_address: str | None = Field(None, description="Ray cluster to join ('auto', 'ray://host:10001'); None = start a local Ray instance")
    ray_num_cpus: int | None = Field(None, ge=1, description="CPUs of a local Ray instance; None = all")
    ray_object_store_mb: int = Field(200, ge=75, description="object store size of a local Ray instance in MB (hand-off chunks travel through it)")

    @field_validator("pd")
    @classmethod
    def _pd_shape(cls, value: str | None) -> str | None:
        if value is not None:
            parse_pd(value)
        return value


def parse_pd(value: str) -> tuple[int, int]:
    """'prefill=P,decode=D' -> (P, D); ValueError naming the bad value otherwise."""
    parts = dict(p.split("=", 1) for p in value.replace(" ", "").split(",") if "=" in p)
    try:
        prefill, decode = int(parts["prefill"]), int(parts["decode"])
    except (KeyError, ValueError):
        raise ValueError(f"pd={value!r}: write it as 'prefill=P,decode=D' with replica counts, e.g. 'prefill=1,decode=1'") from None
    if prefill < 1 or decode < 1 or set(parts) != {"prefill", "decode"}:
        raise ValueError(f"pd={value!r}: needs prefill>=1 and decode>=1 and nothing else")
    return prefill, decode


KEEP_FOREVER = -1.0  # keep_alive: never unload
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: object, *, field: str = "keep_alive") -> float:
    """Ollama's keep_alive: seconds as a number, or a duration string ("30s", "5m", "1h", "1h30m"); 0 =
    unload as soon as idle; any negative value = never unload (returned as KEEP_FOREVER)."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{field}={value!r}: give seconds, a duration such as '5m' or '1h', 0 or -1")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        parts = re.findall(r"(-?\d+(?:\.\d+)?)(ms|s|m|h)?", text)
        if not text or "".join(n + u for n, u in parts) != text or (len(parts) > 1 and not all(u for _, u in parts)):
            raise ValueError(f"{field}={value!r}: give seconds, a duration such as '5m' or '1h', 0 or -1")
        seconds = sum(float(n) * _DURATION_UNITS[u or "s"] for n, u in parts)
    else:
        raise ValueError(f"{field}={value!r}: give seconds, a duration such as '5m' or '1h', 0 or -1")
    if seconds != seconds or seconds > 1e9:
        raise ValueError(f"{field}={value!r}: at most 1e9 seconds (use -1 for never)")
    return KEEP_FOREVER if seconds < 0 else seconds


class RouterConfig(_Section):
    """Several models behind one server (`cllm serve --model NAME=PATH ...`, `models:`, --models-dir): loaded
    on a request's first use, unloaded when idle (cllm/router)."""

    models_dir: str | None = Field(None, description="serve every model in this folder: each GGUF (named by its file stem; a split GGUF's -00001-of-000NN parts as one; an mmproj file beside a model is its projector, not a model) and each Hugging Face model directory (one holding config.json, named by the folder)")
    keep_alive: float = Field(300.0, description="how long a declared model stays loaded after its last request ends (Ollama's keep_alive and semantics: seconds or a duration such as '5m', '1h'; 0 = unload as soon as idle; -1 = never); a model entry or a request's `keep_alive` field overrides it. A server with only the default model (none declared) never unloads it")
    max_loaded_models: int = Field(3, ge=1, le=256, description="models loaded at once; loading one more unloads the least recently used model that has no request in flight (Ollama's OLLAMA_MAX_LOADED_MODELS, 3 on a CPU); with all of them busy the request gets 503 with Retry-After")
    memory_budget_mib: int | None = Field(None, ge=1, description="memory the loaded models may take together, MiB, as measured after each load (host memory the process gained; on CUDA the device memory torch reserved); a model that would not fit beside the others (its size from its last load, else its files' size) unloads idle models first, and with only busy ones left is refused with 503 and Retry-After; null = 85 % of the host memory available when the server starts")
    model_load_timeout_s: float = Field(600.0, gt=0, description="how long a request waits for its model to load; past it 503 with Retry-After (the load goes on)")
    load_retry_s: float = Field(30.0, ge=0, description="after a model failed to load, its requests get 503 model_load_failed (with the error) for this long before a request tries loading it again")
    share_cpu_threads: bool = Field(True, description="llama.cpp models on the CPU that are busy at the same time divide its threads between them (each n_threads / busy models), and take all again when alone (ggml's threads spin-wait for each other: two engines each on every core are both slow); false = each keeps its own count")

    @field_validator("keep_alive", mode="before")
    @classmethod
    def _keep_alive(cls, value: object) -> float:
        return parse_keep_alive(value)


# The sections a model entry (models: list, --model NAME=PATH) may set per model; server, cluster and router
# settings are the server's.
PER_MODEL_SECTIONS = ("model", "llama_cpp", "torch", "embeddings", "scheduler", "speculative", "structured")


class ModelEntry(BaseModel):
    """One model of a multi-model server: a name, a file, and any per-model setting by its flat name
    (n_ctx, n_seq_max, dtype, speculative, ...)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    name: str = Field(description="the name requests use in `model`")
    model: str = Field(description="a GGUF file or a Hugging Face model directory")
    backend: str | None = Field(None, description="llama_cpp or torch; None = follows the file (GGUF: llama_cpp, else torch)")
    aliases: list[str] = Field(default_factory=list, description="more names the model answers to")
    keep_alive: float | None = Field(None, description="this model's keep_alive (router.keep_alive when None)")
    preload: bool = Field(False, description="load it when the server starts instead of on its first request")

    @field_validator("name", "model")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value

    @field_validator("keep_alive", mode="before")
    @classmethod
    def _keep_alive(cls, value: object) -> float | None:
        return None if value is None else parse_keep_alive(value)

    @model_validator(mode="after")
    def _settings_known(self) -> ModelEntry:
        for key in self.settings():
            section = FIELD_SECTION.get(key)
            if section is None:
                raise ValueError(f"model {self.name!r}: unknown setting {key!r}")
            if section not in PER_MODEL_SECTIONS:
                raise ValueError(f"model {self.name!r}: {key!r} is a {section} setting, the server's, not a model's")
        return self

    def settings(self) -> dict[str, Any]:
        """The per-model settings given (flat names)."""
        return dict(self.model_extra or {})


class CllmConfig(_Section):
    """All settings, grouped by section as in config.yaml."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    llama_cpp: LlamaCppConfig = Field(default_factory=LlamaCppConfig)
    torch: TorchConfig = Field(default_factory=TorchConfig)
    embeddings: EmbeddingConfig = Field(default_factory=EmbeddingConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    structured: StructuredConfig = Field(default_factory=StructuredConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    images: ImageConfig = Field(default_factory=ImageConfig)
    models: list[ModelEntry] = Field(default_factory=list, description="the models one server serves (cllm/router): empty = the one model of the model section")

    @model_validator(mode="after")
    def _check_cross_section(self) -> CllmConfig:
        if self.model.deterministic and self.model.backend == "llama_cpp":
            if self.llama_cpp.kv_unified:
                raise ValueError("deterministic: true needs llama_cpp.kv_unified: false (in a unified KV cache a "
                                 "sequence's cells interleave with its batch-mates', and attention sums them in cell order)")
            if self.llama_cpp.flash_attn is False:
                raise ValueError("deterministic: true needs llama_cpp.flash_attn: true or auto (without flash attention "
                                 "llama.cpp's attention matmuls span the whole KV view, whose length follows the batch)")
        budget = self.scheduler.max_num_batched_tokens
        if budget is not None and budget > self.model.n_batch:
            raise ValueError(
                f"max_num_batched_tokens={budget} exceeds n_batch={self.model.n_batch}: "
                "a step cannot carry more tokens than one forward call; raise n_batch or lower the budget"
            )
        return self

    def with_overrides(self, **overrides: Any) -> CllmConfig:
        """A copy with flat overrides applied (and validated)."""
        return build_config(self.to_nested(), overrides)

    def to_nested(self) -> dict[str, Any]:
        return self.model_dump()


SECTIONS: dict[str, type[_Section]] = {
    name: field.annotation for name, field in CllmConfig.model_fields.items()  # type: ignore[misc]
    if name != "models"
}
FIELD_SECTION: dict[str, str] = {
    key: section for section, cls in SECTIONS.items() for key in cls.model_fields
}


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "config"
        value = e.get("input")
        shown = "" if isinstance(value, dict) else f" (got {value!r})"
        lines.append(f"{loc}: {e['msg']}{shown}")
    return "invalid configuration: " + "; ".join(lines)


def build_config(nested: dict[str, Any], flat: dict[str, Any]) -> CllmConfig:
    """Validate a nested dict plus flat overrides into a CllmConfig (ValueError on bad input)."""
    merged: dict[str, Any] = {s: dict(nested.get(s) or {}) for s in SECTIONS}
    merged["models"] = nested.get("models") or []
    unknown_sections = set(nested) - set(SECTIONS) - {"models"}
    if unknown_sections:
        raise ValueError(f"unknown config section(s) {sorted(unknown_sections)}; valid: {sorted(SECTIONS)}")
    for key, value in flat.items():
        if key not in FIELD_SECTION:
            raise ValueError(f"unknown setting {key!r}; valid settings: {', '.join(sorted(FIELD_SECTION))}")
        merged[FIELD_SECTION[key]][key] = value
    try:
        return CllmConfig.model_validate(merged)
    except ValidationError as err:
        raise ValueError(_format_error(err)) from None


_VERBATIM_ENV = frozenset({"api_key", "served_model_name"})


def _env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key in FIELD_SECTION:
        raw = environ.get(f"CLLM_{key.upper()}")
        if raw is not None:
            # YAML parsing turns "4096" into 4096, "true" into True, "null" into None; secrets and
            # names are taken verbatim (CLLM_API_KEY=12345 is the string "12345", "" stays "").
            found[key] = raw if key in _VERBATIM_ENV else yaml.safe_load(raw) if raw != "" else None
    return found


def load_config(path: str | Path | None = None, *, environ: dict[str, str] | None = None, **overrides: Any) -> CllmConfig:
    """Defaults <- YAML file <- CLLM_* environment <- keyword overrides.

    ``path`` None means ``$CLLM_CONFIG`` if set, else no file (defaults). Keyword
    overrides whose value is None are ignored so CLI flags left unset do not
    clobber the file.
    """
    environ = dict(os.environ) if environ is None else environ
    path = path or environ.get("CLLM_CONFIG")
    nested: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {str(p)!r} does not exist")
        nested = yaml.safe_load(p.read_text()) or {}
        if not isinstance(nested, dict):
            raise ValueError(f"config file {str(p)!r} must hold a mapping of sections")
    flat = _env_overrides(environ)
    flat.update({k: v for k, v in overrides.items() if v is not None})
    return build_config(nested, flat)
