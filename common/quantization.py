"""The names `--quantization` takes: which linear weights a model keeps quantized.

No torch: the engine's flags (workers/engine/config.py) are parsed by processes that never load
a model. What each name does is workers/model/quantization.py's (`none`, `int8`, `gguf`)."""

QUANTIZATIONS = ("none", "int8", "gguf")
