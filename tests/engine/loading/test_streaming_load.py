"""A sharded Hugging Face checkpoint loads without being held twice (issue 42): the weights stream from the safetensors
shards tensor by tensor, so host memory while loading stays near one shard, never the whole model twice.

The checkpoint: 3 shards, about 2.1 GB of bf16 (a Llama of width 2048, 14 layers, with model.safetensors.index.json),
written once per module with safetensors; its values repeat one 1M-element random block (writing 1G fresh normals
took longer than the rest of the test). Memory is read from /proc (VmRSS before, VmHWM after, the peak reset in
between by writing 5 to /proc/self/clear_refs), in a child process that loads nothing else; "the runtime" is that
process's resident memory before the load (torch, the engine's modules, a CUDA context).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 2048, 8192, 14, 32000

_CHILD = r"""
import json, sys, torch
from engine.loading.hf_folder import iter_hf_state, read_hf_config
from engine.loading.open_model import open_model

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) << 10

def peak_over_base(load):
    base = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    kept = load()
    return status("VmHWM") - base, kept

path, device = sys.argv[1], torch.device(sys.argv[2])
if device.type == "cuda":
    torch.zeros(1, device=device)  # the CUDA context is part of the runtime
cfg = read_hf_config(path)
streamed, n = peak_over_base(lambda: sum(1 for _ in iter_hf_state(path, cfg, torch.bfloat16)))
loaded, model = peak_over_base(lambda: open_model(path, torch.bfloat16, device, tokenizer=False).model)
on_host = sum(t.numel() * t.element_size() for t in model.state_dict().values() if t.device.type == "cpu")
print(json.dumps({"streamed": streamed, "loaded": loaded, "tensors": n, "on_host": on_host}))
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[int], int]]:
    """(folder, shard sizes in bytes, model bytes) of the 3-shard checkpoint (module docstring); removed after the
    module: 1.9 GB, the suite's largest folder, would otherwise stay until the run ends."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("sharded-llama")
    head_dim = 128
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
           "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": HIDDEN // head_dim,
           "num_key_value_heads": 4, "vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
           "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(cfg))
    kv = 4 * head_dim
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN),
              "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": (kv, HIDDEN),
                       p + "self_attn.v_proj.weight": (kv, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                       p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
                       p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN), p + "mlp.down_proj.weight": (HIDDEN,
                                                                                                  INTERMEDIATE),
                       p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,)})
    block = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 0.02
    total = sum(2 * torch.Size(s).numel() for s in shapes.values())
    groups: list[list[str]] = [[]]
    done = 0
    for name, shape in shapes.items():
        if done >= total * len(groups) / 3:
            groups.append([])
        groups[-1].append(name)
        done += 2 * torch.Size(shape).numel()
    weight_map = {}
    for k, names in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in names:
            n = torch.Size(shapes[name]).numel()
            tensors[name] = block.repeat(-(-n // block.numel()))[:n].view(shapes[name]).clone()
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        del tensors
        weight_map.update(dict.fromkeys(names, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    sizes = [os.path.getsize(folder / f) for f in sorted(set(weight_map.values()))]
    yield str(folder), sizes, total
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_peak_host_memory_while_loading_stays_near_one_shard(checkpoint, device: str) -> None:
    folder, sizes, total = checkpoint
    assert len(sizes) == 3 and 1.9e9 < total < 2.3e9 and max(sizes) < 0.4 * total
    res = subprocess.run([sys.executable, "-c", _CHILD, folder, device], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["tensors"] == 3 + 9 * LAYERS
    # Reading every tensor and dropping it: the reader holds at most about one shard, never the model.
    assert got["streamed"] < 1.3 * max(sizes), got
    if device == "cpu":  # the model itself lives in host memory: it, and no second copy of it
        assert got["on_host"] == total
        assert got["loaded"] < total + 0.3 * max(sizes), got
    else:  # every tensor went to the device as it was read
        assert got["on_host"] == 0
        assert got["loaded"] < 1.3 * max(sizes), got
