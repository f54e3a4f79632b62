"""One embedding peer, run by bench.embed in its own virtual environment (bench.embed --ort-python / --vllm-python):
it imports only the standard library and its own system's packages, never tokenmill.

Usage (bench.embed calls it; by hand for a check):
    PEER_PYTHON -m bench.embed_peer --system ort|vllm --model FOLDER --texts TEXTS.json [--batch N] RESULT.json

- ort: ONNX Runtime on an export of the model folder's BERT (torch.onnx.export of transformers' AutoModel, then
  onnxruntime.transformers.optimizer's BERT fusions: attention, skip layer norm, GELU; what optimum's O2 level
  applies), the texts sorted by length and padded per batch as sentence-transformers does, mean pooling and L2
  normalization in numpy (all-MiniLM-L6-v2's modules). fp32, the session's default threads.
- vllm: vLLM's CPU build, `LLM(model=FOLDER, runner="pooling")` and `LLM.embed(texts)` truncating at max_seq_length,
  its default dtype and batch (its memory share set to 0.25: its default, 0.92 of the machine's RAM, fails to start
  beside any other process).

Writes {"system", "seconds" (best timed pass after one warm-up, wall time), "rows", "dtype", "version"} to RESULT,
and with --save the embeddings of an untimed pass (bench.embed compares them with sentence-transformers').
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path


def _best(fn: Callable[[], object], repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of fn after one untimed warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _max_seq_length(folder: Path) -> int:
    """sentence_bert_config.json's max_seq_length (the truncation every system applies)."""
    return int(json.loads((folder / "sentence_bert_config.json").read_text())["max_seq_length"])


def _onnx_file(folder: Path) -> Path:
    """The folder's BERT exported to ONNX and fused for BERT, cached under /tmp by the folder's path."""
    import torch
    from onnxruntime.transformers.optimizer import optimize_model
    from transformers import AutoConfig, AutoModel

    out = Path("/tmp/tokenmill-bench-onnx") / str(abs(hash(str(folder.resolve()))))
    fused = out / "model.fused.onnx"
    if fused.is_file():
        return fused
    out.mkdir(parents=True, exist_ok=True)
    bert = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()

    class Hidden(torch.nn.Module):  # keyword arguments: the positional order of BertModel.forward changes
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
                    ) -> torch.Tensor:
            return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                        token_type_ids=token_type_ids).last_hidden_state

    ids = torch.ones(2, 16, dtype=torch.int64)
    axes = {0: "batch", 1: "tokens"}
    with torch.no_grad():
        torch.onnx.export(Hidden(), (ids, ids, torch.zeros_like(ids)), out / "model.onnx", dynamo=False,
                          input_names=["input_ids", "attention_mask", "token_type_ids"], output_names=["hidden"],
                          dynamic_axes={"input_ids": axes, "attention_mask": axes, "token_type_ids": axes,
                                        "hidden": axes}, opset_version=17)
    cfg = AutoConfig.from_pretrained(folder)
    optimize_model(str(out / "model.onnx"), model_type="bert", num_heads=cfg.num_attention_heads,
                   hidden_size=cfg.hidden_size).save_model_to_file(str(fused))
    return fused


def run_ort(folder: Path, texts: list[str], batch: int, repeats: int) -> dict:
    """Best seconds of ONNX Runtime embedding `texts` (module docstring)."""
    import numpy as np
    import onnxruntime as ort
    from transformers import AutoTokenizer

    session = ort.InferenceSession(str(_onnx_file(folder)), providers=["CPUExecutionProvider"])
    tok = AutoTokenizer.from_pretrained(folder)
    limit = _max_seq_length(folder)
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))  # sentence-transformers' length sort

    def embed() -> np.ndarray:
        out: list = [None] * len(texts)
        for s in range(0, len(order), batch):
            idx = order[s:s + batch]
            enc = tok([texts[i] for i in idx], padding=True, truncation=True, max_length=limit, return_tensors="np")
            hidden = session.run(None, {k: enc[k].astype(np.int64) for k in
                                        ("input_ids", "attention_mask", "token_type_ids")})[0]
            mask = enc["attention_mask"][..., None].astype(np.float32)
            pooled = (hidden * mask).sum(1) / np.maximum(mask.sum(1), 1e-9)
            for i, vec in zip(idx, pooled / np.linalg.norm(pooled, axis=1, keepdims=True), strict=True):
                out[i] = vec
        return np.stack(out)

    seconds = _best(embed, repeats)
    return {"seconds": seconds, "dtype": "float32", "version": ort.__version__, "embeddings": embed()}


def run_vllm(folder: Path, texts: list[str], repeats: int) -> dict:
    """Best seconds of vLLM's CPU build embedding `texts` (module docstring)."""
    import vllm
    from vllm import LLM

    # its default memory share (0.92 of the RAM, "gpu_memory_utilization" on the CPU too) fails beside any other process
    llm = LLM(model=str(folder), runner="pooling", max_model_len=_max_seq_length(folder), gpu_memory_utilization=0.25)
    cut = {"truncation": True, "max_length": _max_seq_length(folder)}  # as sentence-transformers truncates
    seconds = _best(lambda: llm.embed(texts, use_tqdm=False, tokenization_kwargs=cut), repeats)
    vectors = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False, tokenization_kwargs=cut)]
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    return {"seconds": seconds, "embeddings": vectors, "dtype": dtype, "version": vllm.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", choices=("ort", "vllm"), required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--texts", type=Path, required=True, help="a JSON list of strings")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--save", type=Path, help="write the embeddings here (.npy, float32 [rows, dim])")
    ap.add_argument("result", type=Path)
    args = ap.parse_args()
    texts = json.loads(args.texts.read_text())
    got = (run_ort(args.model, texts, args.batch, args.repeats) if args.system == "ort"
           else run_vllm(args.model, texts, args.repeats))
    import numpy as np

    vectors = got.pop("embeddings")
    if args.save:
        np.save(args.save, np.asarray(vectors, dtype=np.float32))
    args.result.write_text(json.dumps({"system": args.system, "rows": len(texts), **got}))


if __name__ == "__main__":
    main()
