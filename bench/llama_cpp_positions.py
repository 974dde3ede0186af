"""pagemesh scored on exactly the positions llama.cpp's `llama-perplexity` scores, beside its rows.

`bench/peers/llama_cpp.sh perplexity` runs llama-perplexity on the quality texts
(`bench/quantized.py texts`): first the F16 GGUF with `--kl-divergence-base FILE`, which writes
the tokens it evaluated and every scored position's log-probabilities to FILE, then each
quantized GGUF with `--kl-divergence`. Its rule (tools/perplexity/perplexity.cpp): the whole text
is tokenized once (BOS in front only if the vocabulary's `add_bos`), cut into
`n_chunk = len // n_ctx` chunks of n_ctx tokens (the tail is dropped); each chunk is a fresh
sequence at positions 0..n_ctx-1 whose first token becomes BOS if `add_bos`; the logits at
positions n_ctx/2 .. n_ctx-2 are scored against the next token (n_ctx - 1 - n_ctx/2 per chunk).

`score` reads FILE's tokens and runs our models over the same chunks with the same rule, so every
row covers the same positions: per row, KL divergence and greedy (top-token) agreement against
pagemesh bf16 (exact, fp32 logits) and against llama.cpp F16 (the log-probabilities in FILE, with
llama.cpp's own formula: its uint16 encoding over the top 16 nats, terms below e^-16 dropped),
and perplexity. `llama_rows` reads llama.cpp's own figures from its logs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MAGIC = b"_logits_"


@dataclass(frozen=True)
class BaseLogits:
    """A llama-perplexity `--kl-divergence-base` file: header, tokens, per-chunk log-probs."""

    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray  # int32 [n_chunk * n_ctx]
    log_probs: np.ndarray  # uint16 [n_chunk, n_scored, nv], memory-mapped

    @property
    def first(self) -> int:
        return self.n_ctx // 2

    @property
    def n_scored(self) -> int:
        return self.n_ctx - 1 - self.first

    def chunk_tokens(self, i: int) -> list[int]:
        return self.tokens[i * self.n_ctx : (i + 1) * self.n_ctx].tolist()

    def base_log_probs(self, i: int) -> torch.Tensor:
        """fp32 [n_scored, n_vocab] log-probabilities of chunk i as llama.cpp decodes them."""
        rows = self.log_probs[i]
        head = np.ascontiguousarray(rows[:, :4]).view(np.float32)  # [scale, min_log_prob] per row
        q = torch.from_numpy(rows[:, 4 : 4 + self.n_vocab].astype(np.float32))
        return q * torch.from_numpy(head[:, :1].copy()) + torch.from_numpy(head[:, 1:2].copy())


def read_base_logits(path: str | Path) -> BaseLogits:
    with open(path, "rb") as f:
        if f.read(8) != MAGIC:
            raise ValueError(f"{path}: not a llama-perplexity --kl-divergence-base file")
        n_ctx, n_vocab, n_chunk = (int(x) for x in np.frombuffer(f.read(12), dtype=np.int32))
    tokens_at = 8 + 12
    tokens = np.fromfile(path, dtype=np.int32, count=n_chunk * n_ctx, offset=tokens_at)
    nv = 2 * ((n_vocab + 1) // 2) + 4  # llama.cpp's row: 2 floats (4 uint16) then the vocabulary, even
    n_scored = n_ctx - 1 - n_ctx // 2
    log_probs = np.memmap(
        path, dtype=np.uint16, mode="r", offset=tokens_at + 4 * n_chunk * n_ctx, shape=(n_chunk, n_scored, nv)
    )
    return BaseLogits(n_ctx, n_vocab, n_chunk, tokens, log_probs)


@dataclass
class Tally:
    """Running sums for one row over all scored positions."""

    kl_self: float = 0.0
    agree_self: int = 0
    kl_llama: float = 0.0
    agree_llama: int = 0
    nll: float = 0.0
    count: int = 0

    def add(self, logits: torch.Tensor, reference: torch.Tensor, base: torch.Tensor, targets: torch.Tensor) -> None:
        """logits, reference: fp32 [n, vocab] (this row's and pagemesh bf16's); base: llama.cpp
        F16's decoded log-probs [n, vocab]; targets: the next tokens [n]."""
        log_q, log_p = logits.log_softmax(-1), reference.log_softmax(-1)
        self.kl_self += float((log_p.exp() * (log_p - log_q)).sum())
        self.agree_self += int((logits.argmax(-1) == reference.argmax(-1)).sum())
        # llama.cpp's KL: sum over tokens whose base log-prob is above -16 (the rest round to 0)
        kept = base > -16.0
        terms = torch.where(kept, base.exp() * (base - log_q), torch.zeros(()))
        self.kl_llama += float(terms.double().sum())
        self.agree_llama += int((logits.argmax(-1) == base.argmax(-1)).sum())
        self.nll -= float(log_q.gather(1, targets.unsqueeze(1)).double().sum())
        self.count += len(targets)

    def row(self) -> dict[str, float]:
        n = self.count
        return {
            "kl_self": self.kl_self / n,
            "agree_self": self.agree_self / n,
            "kl_llama": self.kl_llama / n,
            "agree_llama": self.agree_llama / n,
            "ppl": float(np.exp(self.nll / n)),
            "positions": n,
        }


def score(base: BaseLogits, runners: dict, references: dict[str, str], logits_of, bos: int | None,
          chunks: int | None = None) -> dict:  # fmt: skip
    """Every runner (label -> runner) over base's chunks, each row's KL and agreement taken against
    the row `references[label]` (its own dense model; listed before it); `logits_of(runner, ids)`
    gives fp32 logits at every position; `bos` replaces each chunk's first token when the
    vocabulary adds BOS (llama.cpp's rule). Returns label -> row."""
    tallies = {label: Tally() for label in runners}
    first, n_ctx = base.first, base.n_ctx
    n_chunk = min(base.n_chunk, chunks or base.n_chunk)
    for i in range(n_chunk):
        ids = base.chunk_tokens(i)
        if bos is not None:
            ids[0] = bos
        targets = torch.tensor(ids[first + 1 : n_ctx])
        base_lp = base.base_log_probs(i)
        logits = {}
        for label, runner in runners.items():
            logits[label] = logits_of(runner, ids)[first : n_ctx - 1]
            tallies[label].add(logits[label], logits[references[label]], base_lp, targets)
        print(f"chunk {i + 1}/{n_chunk}", {k: f"{t.row()['kl_llama']:.4f}" for k, t in tallies.items()}, flush=True)
    return {label: t.row() for label, t in tallies.items()}


LLAMA_FIGURES = {
    "ppl": r"Mean PPL\(Q\)\s*:\s*([\d.]+)",
    "ppl_base": r"Mean PPL\(base\)\s*:\s*([\d.]+)",
    "kl_llama": r"Mean\s+KLD:\s*([\d.]+)",
    "agree_llama": r"Same top p:\s*([\d.]+)",
}


def llama_rows(logs: dict[str, str]) -> dict[str, dict[str, float]]:
    """label -> llama.cpp's own figures from its `--kl-divergence` log (label: that log's path)."""
    rows = {}
    for label, path in logs.items():
        text = Path(path).read_text(errors="replace")
        row = {}
        for key, pattern in LLAMA_FIGURES.items():
            m = re.search(pattern, text)
            if m is None:
                raise ValueError(f"{path}: no {key!r} figure (did llama-perplexity --kl-divergence finish?)")
            row[key] = float(m.group(1))
        row["agree_llama"] /= 100.0
        rows[label] = row
    return rows


def table(ours: dict[str, dict[str, float]], theirs: dict[str, dict[str, float]], base: BaseLogits) -> str:
    lines = [
        "| system | weights | KL vs own dense | top-token agreement vs own dense"
        " | KL vs llama.cpp F16 | agreement vs llama.cpp F16 | perplexity |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, r in ours.items():
        lines.append(
            f"| pagemesh | {label} | {r['kl_self']:.4f} | {r['agree_self']:.2%} | {r['kl_llama']:.4f}"
            f" | {r['agree_llama']:.2%} | {r['ppl']:.3f} |"
        )
    if theirs:
        any_row = next(iter(theirs.values()))
        lines.append(f"| llama.cpp | F16 | 0 | 100% | 0 | 100% | {any_row['ppl_base']:.3f} |")
    for label, r in theirs.items():
        lines.append(
            f"| llama.cpp | {label} | {r['kl_llama']:.4f} | {r['agree_llama']:.2%} | {r['kl_llama']:.4f}"
            f" | {r['agree_llama']:.2%} | {r['ppl']:.3f} |"
        )
    positions = next(iter(ours.values()))["positions"]
    chunks = f"{positions // base.n_scored} chunks of {base.n_ctx} tokens, {base.n_scored} scored in each"
    return "\n".join(lines) + f"\n\n{positions} positions: {chunks}.\n"
