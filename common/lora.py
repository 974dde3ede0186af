"""A LoRA adapter's folder as peft saves it (`adapter_config.json` + `adapter_model.safetensors`),
read and checked without torch: the gateway checks a load request with it, the workers load it.

Served: plain LoRA (`peft_type` LORA) on the decoder layers' linears (q/k/v/o, gate/up/down),
scaled alpha / r (alpha / sqrt(r) with `use_rslora`), per-module ranks and alphas
(`rank_pattern`, `alpha_pattern`). Anything else peft can save (DoRA, biases, trained embeddings
or heads, fan-in-fan-out weights, a subset of layers) is refused by name: an adapter is never
served differently from peft."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# the linears of a decoder layer an adapter may target, by their Hugging Face names
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# adapter_config.json fields whose feature is not served, and the values that mean "not used"
_UNSERVED = {
    "use_dora": (False, None),
    "bias": ("none", None),
    "lora_bias": (False, None),
    "fan_in_fan_out": (False, None),
    "modules_to_save": (None, []),
    "layers_to_transform": (None, []),
    "layer_replication": (None, []),
    "trainable_token_indices": (None, {}, []),
    "target_parameters": (None, []),
    "use_bdlora": (None, False),
    "use_qalora": (False, None),
    "alora_invocation_tokens": (None, []),
}


class AdapterError(ValueError):
    """What is wrong with an adapter, said so that a 400 can carry it. `missing`: the folder or a
    file in it does not exist (a 404 where an API asks for it)."""

    def __init__(self, message: str, missing: bool = False):
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter's checked config: where its weights are, its largest rank, and per targeted
    module name its (rank, scaling)."""

    path: str
    max_rank: int
    modules: dict[str, tuple[int, float]]  # HF module name (e.g. "q_proj") -> (rank, scaling)
    base_model: str | None
    digest: str  # of its config and weights: what it computes, whatever its name or folder

    def rank_of(self, module: str) -> int:
        return self.modules[module][0]

    def scaling_of(self, module: str) -> float:
        return self.modules[module][1]


def read_adapter_spec(path: str | Path, max_rank: int) -> AdapterSpec:
    """The checked config of the adapter folder `path`; AdapterError naming what is wrong."""
    folder = Path(path)
    config_path, weights_path = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not folder.is_dir():
        raise AdapterError(f"lora: no adapter folder at {str(folder)!r}", missing=True)
    for file in (config_path, weights_path):
        if not file.is_file():
            raise AdapterError(f"lora: {str(folder)!r} has no {file.name} (a peft adapter folder)", missing=True)
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"lora: {config_path.name} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"lora: {config_path.name} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"lora: peft_type={config.get('peft_type')!r} is not served (only LORA)")
    for name, unused in _UNSERVED.items():
        if config.get(name, unused[0]) not in unused:
            raise AdapterError(f"lora: {name}={config[name]!r} is not served")
    targets = config.get("target_modules")
    if targets == "all-linear":  # peft's shorthand: every linear but the output head
        targets = list(TARGETS)
    elif isinstance(targets, str):
        raise AdapterError(f"lora: target_modules {targets!r} (a pattern) is not served: list the module names")
    if not isinstance(targets, list) or not targets:
        raise AdapterError("lora: target_modules must name the linears the adapter changes")
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise AdapterError(f"lora: target_modules {unknown} are not served (served: {list(TARGETS)})")
    rank, alpha = _positive(config, "r", int), _positive(config, "lora_alpha", (int, float))
    rank_pattern, alpha_pattern = _pattern(config, "rank_pattern"), _pattern(config, "alpha_pattern")
    modules = {}
    for module in (t for t in TARGETS if t in targets):  # in layer order: a stable first complaint
        r = int(rank_pattern.get(module, rank))
        a = float(alpha_pattern.get(module, alpha))
        if r > max_rank:
            raise AdapterError(f"lora: rank {r} of {module} is above --max-lora-rank {max_rank}")
        scaling = a / math.sqrt(r) if config.get("use_rslora", False) else a / r
        modules[module] = (r, scaling)
    base = config.get("base_model_name_or_path")
    digest = hashlib.blake2b(config_path.read_bytes(), digest_size=16)
    with weights_path.open("rb") as weights:
        for block in iter(lambda: weights.read(1 << 20), b""):
            digest.update(block)
    return AdapterSpec(
        path=str(folder.resolve()),
        max_rank=max(r for r, _ in modules.values()),
        modules=modules,
        base_model=base if isinstance(base, str) else None,
        digest=digest.hexdigest(),
    )


def _positive(config: dict, name: str, kind) -> int | float:
    value = config.get(name)
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        raise AdapterError(f"lora: {name}={value!r} must be a positive number")
    return value


def _pattern(config: dict, name: str) -> dict[str, int | float]:
    """peft's per-module overrides, keyed by a module name or pattern; only plain target names
    (the same value for the module in every layer) are served."""
    pattern = config.get(name) or {}
    if not isinstance(pattern, dict):
        raise AdapterError(f"lora: {name} must be an object")
    for key, value in pattern.items():
        if key not in TARGETS:
            raise AdapterError(f"lora: {name} key {key!r} is not served (only whole target names: {list(TARGETS)})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise AdapterError(f"lora: {name}[{key!r}]={value!r} must be a positive number")
    return pattern


def lora_modules(value) -> tuple[tuple[str, str], ...]:
    """--lora-modules' (name, path) pairs, from NAME=PATH or JSON items (a flag's list, or the
    space-separated $PAGEMESH_LORA_MODULES); ValueError naming a malformed one."""
    import json

    items = value.split() if isinstance(value, str) else (value or ())
    pairs: dict[str, str] = {}
    for item in items:
        if isinstance(item, (tuple, list)) and len(item) == 2:
            name, path = item
        elif isinstance(item, str) and item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                name, path = spec["name"], spec["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f'--lora-modules: {item!r} is not {{"name": ..., "path": ...}}') from None
        elif isinstance(item, str) and "=" in item:
            name, path = item.split("=", 1)
        else:
            raise ValueError(f"--lora-modules: {item!r} is not NAME=PATH")
        if not name or not path:
            raise ValueError(f"--lora-modules: {item!r} needs a name and a path")
        pairs[name] = path
    return tuple(pairs.items())
