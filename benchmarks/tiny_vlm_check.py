"""Check cllm.tiny_vlms end to end: build each tiny VLM, convert it with llama.cpp's converters, then compare
llama.cpp (libmtmd) with transformers on one image of the model's exact image size:

(a) libmtmd's chunk structure for ``<marker>`` alone and the projector output (``mtmd_get_output_embd``);
(b) max |llama.cpp image embeddings - transformers ``get_image_features``|;
(c) teacher-forced logits of a short ChatML prompt containing the image (both sides fed the same token sequence:
    libmtmd's text tokens, the image chunk as the model's image-token placeholders): max |log-softmax diff| over
    the text positions.

llama.cpp runs in a subprocess per family (a native crash is reported, not fatal).

    python benchmarks/tiny_vlm_check.py [--families llava qwen2_vl gemma3] [--assets tests/assets/models]
        [--write-assets DIR] [--json out.json]

``--assets DIR`` uses the GGUFs already in DIR (tiny-<family>-f32.gguf + mmproj-...) instead of converting;
``--write-assets DIR`` converts into DIR (the committed test assets).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = "<|im_start|>user\n{marker}Describe the picture.<|im_end|>\n<|im_start|>assistant\nIt is"


def _llama_side(text_gguf: str, mmproj: str, family: str, q: mp.Queue) -> None:
    try:
        from cllm.tiny_vlms import mtmd_run, sample_image

        image = sample_image(family)
        alone = mtmd_run(Path(text_gguf), Path(mmproj), image, None, decode=False)
        full = mtmd_run(Path(text_gguf), Path(mmproj), image, PROMPT, decode=True)
        q.put({"alone": alone, "full": full})
    except BaseException as e:  # noqa: BLE001
        import traceback

        q.put({"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})


def run_llama_isolated(text_gguf: Path, mmproj: Path, family: str, timeout: float = 300) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_llama_side, args=(str(text_gguf), str(mmproj), family, q))
    p.start()
    try:
        res = q.get(timeout=timeout)
    except Exception:  # noqa: BLE001
        res = {"error": f"llama.cpp subprocess died (exit code {p.exitcode})"}
    p.join(10)
    return res


def check_family(family: str, work: Path, assets: Path | None, write_assets: Path | None) -> dict:
    import numpy as np
    import torch

    from cllm.tiny_vlms import (
        build_tiny_vlm, convert_vlm_to_gguf, hf_image_features, image_placeholder_ids, load_processor,
        model_class, sample_image,
    )

    report: dict = {"family": family}
    t0 = time.perf_counter()
    model_dir = build_tiny_vlm(family, work / family)
    report["build_s"] = round(time.perf_counter() - t0, 1)
    name = family.replace("_", "-")
    if assets is not None:
        text_gguf, mmproj = assets / f"tiny-{name}-f32.gguf", assets / f"mmproj-tiny-{name}-f32.gguf"
    else:
        t0 = time.perf_counter()
        text_gguf, mmproj = convert_vlm_to_gguf(model_dir, write_assets or work / "gguf")
        report["convert_s"] = round(time.perf_counter() - t0, 1)
    report["gguf_bytes"] = [text_gguf.stat().st_size, mmproj.stat().st_size]

    llama = run_llama_isolated(text_gguf, mmproj, family)
    if "error" in llama:
        report["llama_error"] = llama["error"]
        return report
    alone, full = llama["alone"], llama["full"]
    report["use_mrope"], report["use_non_causal"] = alone["use_mrope"], alone["use_non_causal"]
    model = model_class(family).from_pretrained(str(model_dir), dtype=torch.float32).eval()
    processor = load_processor(model_dir)
    tok = processor.tokenizer
    report["chunks_marker_alone"] = [
        {**{k: v for k, v in c.items() if k != "tokens"},
         **({"text": tok.convert_ids_to_tokens(c["tokens"])} if "tokens" in c else {})} for c in alone["chunks"]]

    # (b) projector output vs transformers.
    image = sample_image(family)
    placeholder = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}])
    inputs = processor(text=placeholder, images=[image], return_tensors="pt")
    hf = hf_image_features(model, inputs).numpy()
    lc = alone["image_embd"]
    report["embd_shape"] = {"llama.cpp": list(lc.shape), "transformers": list(hf.shape)}
    if lc.shape == hf.shape:
        report["embd_max_abs_diff"] = float(np.abs(lc - hf).max())
        report["embd_max_abs"] = float(np.abs(hf).max())
        report["embd_rms"] = float(np.sqrt((hf ** 2).mean()))

    # (c) teacher-forced logits on the same token sequence.
    ids = image_placeholder_ids(family, full["chunks"])
    hf_prompt_ids = processor(text=PROMPT.replace("{marker}", _placeholder(family)), images=[image],
                              return_tensors="pt")["input_ids"][0].tolist()
    report["same_tokens_as_hf_processor"] = ids == hf_prompt_ids
    if ids != hf_prompt_ids:
        report["hf_processor_tokens"] = tok.convert_ids_to_tokens(hf_prompt_ids)
    report["chunks_prompt"] = [{k: v for k, v in c.items() if k != "tokens"} for c in full["chunks"]]
    report["prompt_tokens"] = tok.convert_ids_to_tokens(ids)
    fwd = {k: v for k, v in inputs.items() if k in ("pixel_values", "image_grid_thw")}
    input_ids = torch.tensor([ids])
    mm_types = (input_ids == model.config.image_token_id).long()
    if family == "gemma3":
        fwd["token_type_ids"] = mm_types  # image tokens attend to each other bidirectionally, as in llama.cpp
    elif family == "qwen2_vl":
        fwd["mm_token_type_ids"] = mm_types  # M-RoPE positions
    with torch.no_grad():
        logits = model(input_ids=input_ids, **fwd).logits[0].float()
    text_pos = [i for i, t in enumerate(ids) if t != model.config.image_token_id]
    hf_lp = torch.log_softmax(logits[text_pos], -1).numpy()
    lc_lp = torch.log_softmax(torch.from_numpy(full["logits"]).float(), -1).numpy()
    report["n_text_positions"] = len(text_pos)
    report["n_past_llama"] = full["n_past"]
    if hf_lp.shape == lc_lp.shape:
        report["logprob_max_abs_diff"] = float(np.abs(hf_lp - lc_lp).max())
        report["argmax_agree"] = float((hf_lp.argmax(-1) == lc_lp.argmax(-1)).mean())
        # the positions after the image (where the image influences the logits)
        first_after = next(i for i, p in enumerate(text_pos) if p > ids.index(model.config.image_token_id))
        report["logprob_max_abs_diff_after_image"] = float(np.abs(hf_lp[first_after:] - lc_lp[first_after:]).max())
        report["logprob_max_abs_diff_before_image"] = float(np.abs(hf_lp[:first_after] - lc_lp[:first_after]).max())
    else:
        report["logits_shape"] = {"llama.cpp": list(lc_lp.shape), "transformers": list(hf_lp.shape)}
    return report


def _placeholder(family: str) -> str:
    from cllm.tiny_vlms import _IMAGE_PART

    return _IMAGE_PART[family]


def main() -> None:
    from cllm.tiny_vlms import VLM_FAMILIES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=list(VLM_FAMILIES))
    ap.add_argument("--assets", type=Path, default=None)
    ap.add_argument("--write-assets", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    reports = []
    with tempfile.TemporaryDirectory(prefix="cllm-tiny-vlm-") as tmp:
        for family in args.families:
            try:
                r = check_family(family, Path(tmp), args.assets, args.write_assets)
            except Exception as e:  # noqa: BLE001
                import traceback

                r = {"family": family, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
            reports.append(r)
            print(json.dumps(r, indent=1, default=str), flush=True)
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1, default=str))


if __name__ == "__main__":
    main()
