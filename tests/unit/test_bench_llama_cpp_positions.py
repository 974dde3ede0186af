"""bench/llama_cpp_positions.py reads llama-perplexity's `--kl-divergence-base` file (written here
in its format: header, tokens, per position a scale, a minimum and uint16 log-probabilities over
the top 16 nats) and scores rows with llama.cpp's rule and its KL formula."""

import numpy as np
import torch

from pagemesh.bench import llama_cpp_positions as lcp

N_CTX, VOCAB, CHUNKS = 8, 11, 2  # an odd vocabulary: rows are padded to an even count plus 4


def _write_base(path, tokens: np.ndarray, logits: torch.Tensor) -> None:
    """logits [CHUNKS, N_CTX, VOCAB] of the base model, stored as llama-perplexity does."""
    first = N_CTX // 2
    nv = 2 * ((VOCAB + 1) // 2) + 4
    with open(path, "wb") as f:
        f.write(b"_logits_")
        f.write(np.array([N_CTX, VOCAB, CHUNKS], dtype=np.int32).tobytes())
        f.write(tokens.astype(np.int32).tobytes())
        for c in range(CHUNKS):
            for row in logits[c, first : N_CTX - 1].double().numpy():
                top, low = row.max(), max(row.min(), row.max() - 16)
                scale = (top - low) / 65535
                out = np.zeros(nv, dtype=np.uint16)
                lse = top + np.log(np.exp(row - top).sum())
                out[:4] = np.array([scale, low - lse], dtype=np.float32).view(np.uint16)
                out[4 : 4 + VOCAB] = np.where(row > low, np.rint((row - low) / scale), 0)
                f.write(out.tobytes())


def test_base_file_round_trip_and_scores(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (CHUNKS * N_CTX,), generator=gen).numpy()
    base_logits = torch.randn(CHUNKS, N_CTX, VOCAB, generator=gen) * 3
    base_logits[1, :, 0] = -40.0  # below the 16-nat window: stored as 0, dropped from llama.cpp's KL
    _write_base(tmp_path / "base", tokens, base_logits)

    base = lcp.read_base_logits(tmp_path / "base")
    assert (base.n_ctx, base.n_vocab, base.n_chunk, base.n_scored) == (N_CTX, VOCAB, CHUNKS, 3)
    assert base.chunk_tokens(1) == tokens[N_CTX:].tolist()
    for c in range(CHUNKS):
        want = base_logits[c, 4:7].log_softmax(-1)
        got = base.base_log_probs(c)
        kept = want > want.max(-1, keepdim=True).values - 16
        assert torch.allclose(got[kept], want[kept], atol=1e-3)

    # a model identical to the base scores KL ~0 and full agreement; one that is not, does not
    runners = {"same": base_logits, "other": base_logits + torch.randn(base_logits.shape, generator=gen)}

    def logits_of(runner, ids):  # the chunk is recognised by its tokens (BOS is not added here)
        return runner[0 if ids == tokens[:N_CTX].tolist() else 1]

    rows = lcp.score(base, runners, {"same": "same", "other": "same"}, logits_of, bos=None)
    assert rows["same"]["kl_self"] == 0 and rows["same"]["agree_self"] == 1.0
    assert rows["same"]["kl_llama"] < 1e-3 and rows["same"]["agree_llama"] == 1.0
    assert rows["other"]["kl_llama"] > 0.05 and rows["other"]["positions"] == CHUNKS * 3
    assert abs(rows["other"]["kl_llama"] - rows["other"]["kl_self"]) < 0.01  # the same KL, two ways
    targets = torch.from_numpy(tokens).reshape(CHUNKS, N_CTX)[:, 5:8]
    nll = -base_logits[:, 4:7].log_softmax(-1).gather(2, targets.unsqueeze(-1)).mean()
    assert abs(rows["same"]["ppl"] / float(nll.exp()) - 1) < 1e-5
