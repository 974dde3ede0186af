"""What a step costs, in seconds, and what a KV transfer costs: the only parts of the mesh the
simulator replaces.

A step is described by its shape (`StepShape`), which the engine scheduler's real plan gives:
prompt tokens run (prefill chunks), decode rows, and the attention work of each. Two models:

  LinearStepCost    t = base + a·prefill_tokens + b·prefill_attention + c·decode_rows
                    + d·decode_context, fitted by least squares (non-negative) to steps the
                    real engine ran on this machine (`pagemesh simulate calibrate`).
  RooflineStepCost  a GPU: max(FLOPs / (peak·mfu), bytes / (HBM·mbu)) + the tensor-parallel
                    all-reduces + a fixed host overhead per step, for a model given by its shape.

A KV transfer (prefill → decode worker) costs latency + bytes / bandwidth (`TransferModel`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from pagemesh.common.model_config import ModelConfig


@dataclass(frozen=True)
class StepShape:
    """One engine step's work, from its plan."""

    prefill_tokens: int = 0  # prompt tokens run this step (every chunk that is not a decode)
    prefill_attention: int = 0  # sum over prefill chunks of tokens × mean context they attend to
    decode_rows: int = 0
    decode_context: int = 0  # sum of the decode rows' context lengths

    def features(self) -> list[float]:
        return [1.0, self.prefill_tokens, self.prefill_attention, self.decode_rows, self.decode_context]


FEATURES = ("base_s", "per_prefill_token_s", "per_prefill_attention_s", "per_decode_row_s", "per_decode_context_s")


@dataclass(frozen=True)
class LinearStepCost:
    """Seconds per step as a non-negative linear function of its shape (see the module doc)."""

    base_s: float
    per_prefill_token_s: float
    per_prefill_attention_s: float
    per_decode_row_s: float
    per_decode_context_s: float
    source: str = ""

    def step_time(self, shape: StepShape) -> float:
        coefs = [getattr(self, name) for name in FEATURES]
        return float(np.dot(coefs, shape.features()))

    @classmethod
    def fit(cls, samples: list[tuple[StepShape, float]], source: str = "") -> LinearStepCost:
        """Least squares over (shape, seconds) samples, coefficients kept >= 0 (a coefficient that
        comes out negative is dropped and the rest refitted: the active-set method, small here)."""
        x = np.array([shape.features() for shape, _ in samples], dtype=np.float64)
        y = np.array([seconds for _, seconds in samples], dtype=np.float64)
        active = list(range(x.shape[1]))
        coefs = np.zeros(x.shape[1])
        while active:
            solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
            if (solution >= 0).all():
                coefs[active] = solution
                break
            active.pop(int(np.argmin(solution)))
        return cls(*coefs.tolist(), source=source)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> LinearStepCost:
        data = json.loads(Path(path).read_text())
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


@dataclass(frozen=True)
class GPU:
    """Datasheet figures (dense bf16, HBM, the GPU-to-GPU link inside a node) and the shares of
    them a serving step reaches (mfu/mbu: typical of tuned engines; no measured figure here)."""

    name: str
    bf16_flops: float
    hbm_bytes_per_s: float
    memory_bytes: float
    link_bytes_per_s: float  # NVLink, one direction
    mfu: float = 0.5
    mbu: float = 0.75
    step_overhead_s: float = 0.004  # scheduling, sampling, launch gaps around a step's kernels
    all_reduce_latency_s: float = 10e-6


GPUS = {
    # NVIDIA's H100 SXM / H200 SXM datasheets: 989 TFLOP/s dense bf16; 3.35 / 4.8 TB/s; 80 / 141 GB;
    # NVLink 4: 900 GB/s both directions.
    "h100": GPU("H100 SXM", 989e12, 3.35e12, 80e9, 450e9),
    "h200": GPU("H200 SXM", 989e12, 4.8e12, 141e9, 450e9),
}


@dataclass(frozen=True)
class RooflineStepCost:
    """A step of `model` on `tp` GPUs of one kind, each holding 1/tp of the weights and KV heads."""

    gpu: GPU
    model: ModelConfig
    tp: int = 1
    dtype_bytes: int = 2

    @property
    def weight_bytes(self) -> float:
        m = self.model
        attn = m.hidden_size * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
        mlp = 3 * m.hidden_size * m.intermediate_size
        embed = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
        return (m.num_layers * (attn + mlp) + embed) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        m = self.model
        return 2 * m.num_layers * m.num_kv_heads * m.head_dim * self.dtype_bytes

    def step_time(self, shape: StepShape) -> float:
        m, g = self.model, self.gpu
        tokens = shape.prefill_tokens + shape.decode_rows
        if tokens == 0:
            return 0.0
        matmul_flops = 2 * (self.weight_bytes / self.dtype_bytes) * tokens
        attended = shape.prefill_attention + shape.decode_context  # (query token, key) pairs
        attention_flops = 4 * m.num_layers * m.num_heads * m.head_dim * attended
        kv_read = self.kv_bytes_per_token * (shape.decode_context + shape.prefill_tokens)
        compute = (matmul_flops + attention_flops) / self.tp / (g.bf16_flops * g.mfu)
        memory = (self.weight_bytes + kv_read) / self.tp / (g.hbm_bytes_per_s * g.mbu)
        return max(compute, memory) + self.all_reduce_time(tokens) + g.step_overhead_s

    def all_reduce_time(self, tokens: int) -> float:
        """Two ring all-reduces of the hidden states per layer (after attention and after the MLP)."""
        if self.tp == 1:
            return 0.0
        size = tokens * self.model.hidden_size * self.dtype_bytes
        per = 2 * (self.tp - 1) / self.tp * size / self.gpu.link_bytes_per_s + self.gpu.all_reduce_latency_s
        return 2 * self.model.num_layers * per

    def kv_pages(self, page_size: int, memory_fraction: float = 0.9) -> int:
        """KV pages one worker (tp GPUs) holds: its memory share less the weights."""
        free = self.tp * self.gpu.memory_bytes * memory_fraction - self.weight_bytes
        return max(0, int(free // (self.kv_bytes_per_token * page_size)))


@dataclass(frozen=True)
class TransferModel:
    """A KV handoff's time: latency + bytes / bandwidth."""

    bytes_per_s: float
    latency_s: float = 0.0

    def time(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s


LINKS = {
    "loopback": TransferModel(2e9, 0.002),  # zmq over loopback between two processes on this machine
    "nvlink": TransferModel(450e9, 10e-6),
    "pcie5": TransferModel(50e9, 10e-6),
    "rdma400": TransferModel(50e9, 20e-6),  # one 400 Gb/s NIC
    "ethernet100": TransferModel(12.5e9, 50e-6),
}


# Shapes of well-known models (their published config.json), for GPU-scale what-ifs offline.
MODEL_SHAPES = {
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                         num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
                         tie_word_embeddings=False),
    "llama-3.1-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
                          num_heads=64, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
                          tie_word_embeddings=False),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                         num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
                         tie_word_embeddings=True),
}  # fmt: skip


def model_shape(name: str) -> ModelConfig:
    """A ModelConfig from MODEL_SHAPES, or from a model folder / GGUF file path."""
    if name in MODEL_SHAPES:
        return ModelConfig(architecture="llama", rms_norm_eps=1e-5, rope_theta=500000.0, **MODEL_SHAPES[name])
    from pagemesh.common.model_config import read_model_config

    return read_model_config(Path(name))
