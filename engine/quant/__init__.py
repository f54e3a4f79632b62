"""The held forms of a weight and the modules that serve them: one class per held form with create / process after
load / apply and HELD_FORMS, the table of them by device (engine.quant.forms); the INT4 format in three layers after
gpt-fast's quantize.py (qparams: engine.quant.qparams, a handler that builds a model from a quantized state dict:
engine.quant.handler, thin modules: engine.quant.int4_linear), stacked expert INT4 (engine.quant.stacked_int4,
engine.quant.experts), INT8 W8A8 (engine.quant.int8_linear), oneDNN-packed plain linears
(engine.quant.packed_linear), shared names and module replacement (engine.quant.state, a leaf), and what the engine
does to a filled model before its first step (engine.quant.after_load). The producers of quantized weights (GPTQ,
tuning, folders) are engine.ptq; where bytes come from and which stored format becomes which held form:
engine.loading.

NOTE: imports nothing itself; import the modules.
"""
