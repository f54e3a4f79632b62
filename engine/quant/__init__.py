"""INT4 weight-only quantization (W4A16, group-wise) in three layers, after gpt-fast's quantize.py:
qparams (engine.quant.qparams), a handler (engine.quant.handler) and thin modules (engine.quant.int4_linear);
shared names and module replacement (engine.quant.state, a leaf), the driver that runs round-to-nearest or GPTQ
then tuning (engine.quant.quantize), GGUF Q4 mapping (engine.loading.gguf_int4), model folders
(engine.loading.tokenmill_folder)
and loading (engine.loading.quantized).

NOTE: imports nothing itself, so `engine.loading.tokenmill_folder`'s names reach the CLI without torch; import the
modules.
"""
