"""The producers of quantized weights (post-training quantization), apart from where bytes come from
(engine.loading) and from the held forms that serve them (engine.quant): round-to-nearest or GPTQ then end-to-end
tuning of a filled model (engine.ptq.quantize, engine.ptq.gptq, engine.ptq.refit, engine.ptq.tune) on calibration
text (engine.ptq.calibration), and `tokenmill quantize`'s folders (engine.ptq.to_folder). They read models through
the one loading entry point (engine.loading.open_model); nothing in engine.loading or engine.quant imports them.
SmoothQuant stays in engine.quant.smoothquant as the INT8 W8A8 form's from-float step at load
(engine.quant.forms.Int8W8A8Form.from_float_model): here it would close a loading -> ptq -> loading package cycle.

NOTE: imports nothing itself; import the modules.
"""
