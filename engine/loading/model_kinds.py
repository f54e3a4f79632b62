"""The files that tell what a model is: a GGUF file's magic number, and the config file a model folder holds (a
`tokenmill quantize` folder's or a Hugging Face folder's). Shared by engine.loading.model_files (fsspec URLs) and
engine.loading.hub (hub ids)."""

GGUF_MAGIC = b"GGUF"
TOKENMILL_CONFIG_FILE = "tokenmill_model.json"
HF_CONFIG_FILE = "config.json"
FOLDER_CONFIG_FILES = (TOKENMILL_CONFIG_FILE, HF_CONFIG_FILE)
