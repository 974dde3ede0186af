"""Every dense model family gives Hugging Face transformers' greedy tokens (issue 30).

For each family a tiny random-weight checkpoint is made here by transformers (fixed seed, fp32,
the output head scaled so that logits are spread out and no near-tie decides a greedy token)
and saved as a safetensors folder with a tokenizer and a chat template, as a model from the hub
comes. The engine serves it single-rank: 8 prompts x 24 greedy tokens, prefill chunks batched
with decodes, equal to HF's greedy continuation (teacher-forced: `hf_argmax_after_each`). The
mesh and tensor parallelism: test_model_families_mesh.py, on the same checkpoints.

Each checkpoint carries its family's distinguishing features, and a test here shows each one
changes HF's tokens, so that equality cannot come from a feature being ignored on both sides.
Also here: embeddings (pooled final-norm hidden states) for every family. GGUF files:
test_model_families_gguf.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagemesh.common.sampling import SamplingParams
from pagemesh.tests.integration.conftest import hf_argmax_after_each

pytestmark = pytest.mark.slow

VOCAB = 320
PROMPT_LENGTHS = (1, 3, 7, 12, 17, 25, 33, 40)  # past every window below, beside 24 new tokens
NEW_TOKENS = 24
WINDOW = 8  # the sliding layers' window
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.3,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
CHAT_TEMPLATE = (  # "w3 {content} w4 " per message, then "w5"
    "{% for message in messages %}w3 {{ message['content'] }} w4 {% endfor %}"
    "{% if add_generation_prompt %}w5{% endif %}"
)


def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=32, tie_word_embeddings=False))


PHI3_ORIGINAL_CONTEXT = 64  # LongRoPE's pretraining context: served up to here (prompts + 24 tokens fit)


def phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    half = SHAPE["hidden_size"] // SHAPE["num_attention_heads"] // 2
    rope = {
        "rope_type": "longrope",
        "rope_theta": 1e4,
        "short_factor": [1.0 + 0.5 * i for i in range(half)],
        "long_factor": [2.0 + i for i in range(half)],
        "original_max_position_embeddings": PHI3_ORIGINAL_CONTEXT,
    }
    cfg = Phi3Config(
        **SHAPE, sliding_window=WINDOW, tie_word_embeddings=False, rope_parameters=rope,
        original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT,
    )  # fmt: skip
    return Phi3ForCausalLM(cfg)


def gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    # layers 0 and 2 slide; HF's default soft-caps (attention 50, logits 30) made to bite at this size
    cfg = Gemma2Config(
        **SHAPE, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=2.0,
        final_logit_softcapping=8.0,
    )  # fmt: skip
    return Gemma2ForCausalLM(cfg)


def gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    rope = {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    cfg = Gemma3TextConfig(
        **SHAPE, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, rope_parameters=rope,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=8.0,
    )  # fmt: skip
    return Gemma3ForCausalLM(cfg)


def llama_yarn():
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e4}
    return LlamaForCausalLM(LlamaConfig(**SHAPE, rope_parameters=rope, tie_word_embeddings=False))


FAMILIES = {"qwen3": qwen3, "phi3": phi3, "gemma2": gemma2, "gemma3": gemma3, "llama-yarn": llama_yarn}
HEAD_SCALE = {"gemma2": 1.0, "gemma3": 1.0}  # tied heads: the embedding's scale sets the spread


def build(family: str):
    """The family's tiny HF model, fp32, random weights from seed 0 (the norms' too, which HF
    starts all equal, so that no two norms could be swapped unseen), its head scaled."""
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
        if model.config.tie_word_embeddings:
            model.model.embed_tokens.weight.mul_(HEAD_SCALE.get(family, 1.0))
        else:
            model.lm_head.weight.mul_(4.0)  # spread-out logits: no near-tie decides a greedy token
    return model


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer whose token i is the word `w{i}` (text and ids map one to one, so a
    completion's text gives its token ids), with a chat template, as a hub folder has them."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "w1", "eos_token": "w2", "add_bos_token": False, "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def save_checkpoint(family: str, folder: Path):
    model = build(family)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    return model


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory):
    """family -> (folder, HF model), each made on first use."""
    made: dict[str, tuple[Path, object]] = {}

    def get(family: str):
        if family not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{family}")
            made[family] = folder, save_checkpoint(family, folder)
        return made[family]

    return get


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def hf_greedy_all(hf, prompt_list: list[list[int]], served: list[list[int]]) -> list[list[int]]:
    """HF's greedy choice after each prompt and each prefix of what was served (equal to
    `served` exactly when it is HF's greedy continuation)."""
    return [hf_argmax_after_each(hf, p, s) for p, s in zip(prompt_list, served)]


def hf_logprobs_of(hf, prompt: list[int], served: list[int]) -> tuple[list[float], float]:
    """HF's log-probability of each served token, teacher-forced, and the smallest gap between
    its two best logits over those steps (how near a tie the closest greedy choice was)."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + served])).logits[0, len(prompt) - 1 : -1].float()
    top2 = logits.topk(2).values
    logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(served)[:, None])[:, 0]
    return logprobs.tolist(), float((top2[:, 0] - top2[:, 1]).min())


# Our logprobs differ from HF's by under 1e-4 here (fp32, other summation orders); a greedy step
# whose two best logits are closer than this could go either way, so the tests check none is.
NEAR_TIE = 2e-3


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["c-kernels", "torch-fallback"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_greedy_tokens_equal_hf(family, cpu_kernels, family_checkpoints, monkeypatch):
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine
    from pagemesh.workers.model.registry import model_class

    if not cpu_kernels:  # the path taken where no C compiler is found
        monkeypatch.setattr("pagemesh.workers.engine.backend.cpu_kernels_usable", lambda dtype: False)
    folder, hf = family_checkpoints(family)
    engine = Engine(
        EngineConfig(model=str(folder), dtype="float32", max_num_batched_tokens=16, max_prefill_chunk=16, num_pages=128)
    )
    assert type(engine.runner.model) is model_class(engine.model_config)
    ps = prompts()
    results = engine.generate(ps, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0))
    served = [r.token_ids[0] for r in results]
    assert all(len(s) == NEW_TOKENS for s in served)
    assert served == hf_greedy_all(hf, ps, served)
    for prompt, tokens, result in zip(ps, served, results):  # the logits' scale too (final soft-capping)
        ours = [lp.logprob for lp in result.logprobs[0]]
        theirs, closest = hf_logprobs_of(hf, prompt, tokens)
        assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-3
        assert closest > NEAR_TIE  # no near-tie decided a token
    engine.blocks.check_invariants([])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_embeddings_are_hf_final_norm_hidden_states(family, family_checkpoints):
    """Pooling (the last token's final-norm hidden state, L2-normalised) for every family: the
    family's own final norm (Gemma's (1 + w)) is the one pooled."""
    from pagemesh.common.messages import Pooling
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    folder, hf = family_checkpoints(family)
    engine = Engine(EngineConfig(model=str(folder), dtype="float32", max_num_batched_tokens=16, num_pages=64))
    ps = prompts()[3:6]  # 12, 17 and 25 tokens: one and two prefill chunks
    for i, ids in enumerate(ps):
        engine.admit_embedding(f"emb-{i}", ids, Pooling.LAST)
    vectors = {}
    while engine.has_unfinished():
        vectors |= {out.request_id: out.embedding for out in engine.step() if out.embedding is not None}
    for i, ids in enumerate(ps):
        with torch.inference_mode():
            hidden = hf.model(torch.tensor([ids])).last_hidden_state[0, -1]
        reference = torch.nn.functional.normalize(hidden, dim=0)
        assert float((torch.tensor(vectors[f"emb-{i}"]) - reference).abs().max()) < 1e-4
    engine.blocks.check_invariants([])


def hf_outputs_differ(hf, other) -> bool:
    """Whether `other` (the same weights, one feature changed) gives other greedy tokens or
    log-probabilities (by more than the tests' 1e-3) than `hf` on the test prompts, doubled to
    reach past the windows."""
    other.load_state_dict(hf.state_dict())
    with torch.inference_mode():
        for p in prompts():
            ids = torch.tensor([p + p])
            a, b = torch.log_softmax(hf(ids).logits, -1), torch.log_softmax(other.eval()(ids).logits, -1)
            if not torch.equal(a.argmax(-1), b.argmax(-1)) or (a - b).abs().max() > 1e-3:
                return True
    return False


def variant(hf, **changes):
    """An HF model of `hf`'s class and config with `changes` applied."""
    import copy

    cfg = copy.deepcopy(hf.config)
    for key, value in changes.items():
        setattr(cfg, key, value)
    return type(hf)(cfg)


@pytest.mark.parametrize(
    ("family", "changes"),
    [
        ("phi3", {"sliding_window": None}),
        ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}),
        ("gemma2", {"sliding_window": 4096}),
        ("gemma2", {"attn_logit_softcapping": None}),
        ("gemma2", {"final_logit_softcapping": None}),
        ("gemma3", {"sliding_window": 4096}),
        ("gemma3", {"final_logit_softcapping": None}),
        ("gemma3", {"query_pre_attn_scalar": 16}),
        (
            "gemma3",
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                }
            },
        ),  # fmt: skip
        (
            "gemma3",
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e6},
                }
            },
        ),  # fmt: skip
        ("llama-yarn", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}),
    ],
)
def test_each_checkpoints_features_change_hf_tokens(family, changes, family_checkpoints):
    """The feature matters on these prompts: ignoring it would fail the equality above."""
    _, hf = family_checkpoints(family)
    assert hf_outputs_differ(hf, variant(hf, **changes))
