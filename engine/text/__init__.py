"""Text in and out: the tokenizer (chat template, special tokens), incremental detokenizing with stop strings, prompts.

NOTE: imports nothing itself; import the modules.
"""
