"""The one table of weight forms (engine.quant.forms.HELD_FORMS) walked: every held form is created, processed after
load and applied on a small random linear on the CPU, and matches the fp32 reference within its tolerance, and
answers its held weight's shape, memory-fit fields and float tensor; what it says serves each form on each device
exists; every stored format (engine.loading.stored_formats) becomes a held form of the table."""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from engine.kernels.gguf_blocks import GGUFBlocks
from engine.loading.stored_formats import STORED_FORMATS
from engine.quant.forms import HELD_FORMS, HeldForm, held_form_of
from engine.quant.int8_linear import int8_available, int8_weight_qmax, quantize_weight_int8
from engine.quant.packed_linear import gguf_kernel_scope, packing_available
from engine.quant.qparams import Int4Weight, Int8Weight, quantize_int4
from engine.quant.stacked_int4 import StackedInt4

N, K, M, EXPERTS, GROUP = 48, 128, 5, 3, 32


def _held(name: str, w: torch.Tensor) -> tuple[HeldForm, object]:
    """The form `name` in fp32 on the CPU and the held weight it holds of the fp32 weight `w` ([E, N, K] for the
    stacked experts): as a load makes it (round-to-nearest INT4 / INT8, a GGUF Q8_0 tensor's blocks)."""
    if name == "dense":
        return HELD_FORMS[name](), w
    if name == "gguf_blocks":
        raw = gguf_quantize(w.numpy().astype(np.float32), GGMLQuantizationType.Q8_0)
        return HELD_FORMS[name](type_name="Q8_0"), GGUFBlocks.from_raw(raw, "Q8_0", tuple(w.shape))
    if name == "int4":
        return HELD_FORMS[name](group_size=GROUP), quantize_int4(w, GROUP)
    if name == "int8_w8a8":
        return HELD_FORMS[name](), Int8Weight(*quantize_weight_int8(w, int8_weight_qmax()))
    if name == "stacked_int4":
        return (HELD_FORMS[name](num_experts=EXPERTS, group_size=GROUP),
                StackedInt4.from_weights([quantize_int4(e, GROUP) for e in w]))
    raise AssertionError(f"the walk does not know held form {name!r}: add it here")


def _parts(weight: object) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each tensor part of a held weight (the tensor itself for a plain one)."""
    if isinstance(weight, torch.Tensor):
        return {"weight": (tuple(weight.shape), weight.dtype)}
    return {f.name: (tuple(v.shape), v.dtype) for f in dataclasses.fields(weight)
            if isinstance(v := getattr(weight, f.name), torch.Tensor)}


@pytest.mark.parametrize("name", sorted(HELD_FORMS))
def test_every_held_form_is_created_processed_and_applied(name: str) -> None:
    if name == "int8_w8a8" and not int8_available():
        pytest.skip("torch without oneDNN's int8 ops")
    if name in ("dense", "gguf_blocks") and not packing_available():
        pytest.skip("torch without oneDNN")
    gen = torch.Generator().manual_seed(0)
    stacked = name == "stacked_int4"
    lead = (EXPERTS,) if stacked else ()
    w = torch.randn(*lead, N, K, generator=gen)
    bias = torch.randn(*lead, N, generator=gen)
    x = torch.randn(*lead, M, K, generator=gen)
    form, held = _held(name, w)

    empty = form.create(N, K)
    assert held_form_of(empty) is held_form_of(held) is type(form)
    assert _parts(empty) == _parts(held)  # the parts a reader fills, as a load holds them
    assert {t.device.type for t in (empty,) if isinstance(t, torch.Tensor)} <= {"meta"}

    layer = form.process_after_load(held, bias)
    ref = x @ w.transpose(-1, -2) + bias[..., None, :]
    with gguf_kernel_scope(True):  # GGUF blocks: the small-batch kernel serves these few rows
        y = form.apply(layer, x)
    assert y.shape == ref.shape and y.dtype == torch.float32
    err = float((y - ref).abs().max() / ref.abs().max())
    assert err <= form.tolerance, f"{name}: relative error {err:.2e} above its tolerance {form.tolerance}"
    if name != "dense":  # a quantized form is not the fp32 weights: the walk would not see a form that ignores them
        assert err > 1e-6

    # what the engine asks of any held weight, answered by its form (no switch on the weight's type)
    cls = type(form)
    assert cls.held_shape(held) == tuple(w.shape)
    assert type(cls.for_weight(held, torch.float32, "cpu")) is cls
    fields = cls.held_fields(held)
    assert fields[0] >= w.numel() and fields[1] == (GROUP if name in ("int4", "stacked_int4") else None)
    dense = cls.to_float(held, torch.float32)
    assert dense.shape == w.shape and dense.dtype == torch.float32
    assert float((dense - w).abs().max() / w.abs().max()) <= form.tolerance
    if name != "int4":
        with pytest.raises(ValueError, match="serves linears only"):
            form.process_embedding(held)


def test_the_table_names_a_kernel_that_exists_per_device() -> None:
    for name, form in HELD_FORMS.items():
        assert form.name == name and set(form.served_by) <= {"cpu", "cuda"} and "cpu" in form.served_by
        for device, dotted in form.served_by.items():
            module, _, attr = dotted.rpartition(".")
            assert hasattr(importlib.import_module(module), attr), f"{name} on {device}: {dotted} does not exist"
    assert HELD_FORMS["int8_w8a8"].kernel_for("cpu") == "engine.quant.int8_linear.Int8Linear"
    with pytest.raises(ValueError, match="no kernel on cuda"):
        HELD_FORMS["int8_w8a8"].kernel_for("cuda")
    with pytest.raises(TypeError, match="no held weight"):
        held_form_of([1, 2])
    assert {f.held_type for f in HELD_FORMS.values()} == {torch.Tensor, GGUFBlocks, Int4Weight, Int8Weight,
                                                         StackedInt4}


def test_every_stored_format_becomes_a_held_form_of_the_table() -> None:
    assert len(STORED_FORMATS) > 10
    for stored, fmt in STORED_FORMATS.items():
        assert fmt.held in HELD_FORMS and fmt.otherwise in HELD_FORMS, stored
        importlib.import_module(fmt.reader)
    assert {fmt.held for fmt in STORED_FORMATS.values()} | {"gguf_blocks"} == set(HELD_FORMS)
