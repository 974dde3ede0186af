"""LoRA adapters batched in one forward (workers/model/lora.py) against HF + peft, the oracle:
rows of the base model and of two adapters (rank 8 on every linear, rank 16 with rsLoRA and its
own alpha on some) in ONE mixed step give, row for row, the logits peft gives each alone (fp32).
And an adapter that does not fit is refused whole, by name."""

from __future__ import annotations

import json

import pytest
import torch

from pagemesh.common.lora import AdapterError, read_adapter_spec
from pagemesh.tests.lora_adapters import ALL_LINEARS, tiny_llama, tiny_llama_with_adapters
from pagemesh.workers.attention.metadata import AttentionMetadata
from pagemesh.workers.engine.backend import TorchAttentionBackend
from pagemesh.workers.model.llama import ForwardContext
from pagemesh.workers.model.loader import load_model
from pagemesh.workers.model.lora import attach_lora, clear_slot, load_adapter
from pagemesh.workers.model.ops import TorchOps

CPU = torch.device("cpu")
PAGE = 4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return root, tiny_llama_with_adapters(root)


def _forward(model, prompts: list[list[int]], row_slots: list[int]) -> torch.Tensor:
    """Logits of every row of one mixed prefill step over `prompts`, row_slots per prompt."""
    cfg = model.config
    pages = 1 + sum((len(p) + PAGE - 1) // PAGE for p in prompts)
    kv = torch.zeros(cfg.num_layers, pages, 2, PAGE, cfg.num_kv_heads, cfg.head_dim)
    tables, page = [], 1
    for p in prompts:
        n = (len(p) + PAGE - 1) // PAGE
        tables.append(list(range(page, page + n)))
        page += n
    lens = [len(p) for p in prompts]
    md = AttentionMetadata.build(lens, lens, tables, PAGE, CPU, for_cpu=True)
    ids = torch.tensor([t for p in prompts for t in p])
    rows = torch.tensor([s for p, s in zip(prompts, row_slots) for _ in p])
    model.lora_batch.set_rows(rows)
    ctx = ForwardContext(kv, md, TorchAttentionBackend(), TorchOps())
    return model(ids, ctx, torch.arange(len(ids)))


@pytest.mark.parametrize("kernel", ["c", "torch"])
def test_base_and_two_adapters_in_one_step_give_each_its_peft_logits(folders, kernel, monkeypatch):
    """The C kernel (a CPU's default) and the masked GEMMs (the GPU's and the fallback) alike."""
    if kernel == "torch":
        monkeypatch.setenv("PAGEMESH_LORA_KERNEL", "torch")
    root, peft_models = folders
    model = load_model(root / "base", torch.float32, CPU)
    batch = attach_lora(model, slots=3, max_rank=16)
    assert (batch.kernel is not None) == (kernel == "c")
    load_adapter(model, 2, read_adapter_spec(root / "a", max_rank=16))  # any slot: not the first
    load_adapter(model, 0, read_adapter_spec(root / "b", max_rank=16))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 9, 7, 6)]
    slots = [-1, 2, 0, 2]  # base, a, b, a
    logits = _forward(model, prompts, slots)
    base = tiny_llama()
    expected = []
    with torch.inference_mode():
        for p, slot in zip(prompts, slots):
            hf = base if slot < 0 else peft_models["a" if slot == 2 else "b"]
            expected.append(hf(torch.tensor([p])).logits[0])
    expected = torch.cat(expected)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    # an adapter's rows really differ from the base's (the test would catch a LoRA not applied)
    assert (expected[5:14] - base(torch.tensor([prompts[1]])).logits[0]).abs().max() > 1e-2

    clear_slot(model, 2)  # a cleared slot computes the base model
    again = _forward(model, prompts[1:2], [2])
    with torch.inference_mode():
        torch.testing.assert_close(again, base(torch.tensor([prompts[1]])).logits[0], rtol=1e-4, atol=1e-4)


def test_no_adapter_rows_is_the_base_model_bit_for_bit(folders):
    root, _ = folders
    plain = load_model(root / "base", torch.float32, CPU)
    adapted = load_model(root / "base", torch.float32, CPU)
    attach_lora(adapted, slots=2, max_rank=16)
    load_adapter(adapted, 0, read_adapter_spec(root / "a", max_rank=16))
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    attach_lora(plain, slots=1, max_rank=8)
    assert torch.equal(_forward(adapted, prompts, [-1, -1]), _forward(plain, prompts, [-1, -1]))


def test_adapters_that_do_not_fit_are_refused_by_name_and_leave_the_slot_as_it_was(folders, tmp_path):
    root, _ = folders
    with pytest.raises(AdapterError, match="rank 16 of q_proj is above --max-lora-rank 8"):
        read_adapter_spec(root / "b", max_rank=8)
    with pytest.raises(AdapterError, match="no adapter folder") as missing:
        read_adapter_spec(tmp_path / "nowhere", max_rank=8)
    assert missing.value.missing
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((root / "a" / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes((root / "a" / "adapter_model.safetensors").read_bytes())
    with pytest.raises(AdapterError, match="use_dora=True is not served"):
        read_adapter_spec(dora, max_rank=16)

    # an adapter made for another base model (wider hidden size): refused, the slot keeps adapter a
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    get_peft_model(other, LoraConfig(r=8, target_modules=ALL_LINEARS, init_lora_weights=False)).save_pretrained(
        tmp_path / "other"
    )
    model = load_model(root / "base", torch.float32, CPU)
    attach_lora(model, slots=1, max_rank=16)
    load_adapter(model, 0, read_adapter_spec(root / "a", max_rank=16))
    before = _forward(model, [[1, 2, 3]], [0])
    with pytest.raises(AdapterError, match="an adapter of another base model"):
        load_adapter(model, 0, read_adapter_spec(tmp_path / "other", max_rank=16))
    assert torch.equal(_forward(model, [[1, 2, 3]], [0]), before)


def test_a_tensor_parallel_engine_serves_adapters_as_one_rank_does(folders):
    """-tp 2: each rank holds its shard of every adapter (B by output rows where the base linear is
    column-parallel, A by input columns where it is row-parallel); an adapter's greedy tokens, and
    the base model's beside them, equal the single-rank engine's."""
    from pagemesh.common.sampling import SamplingParams
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    root, _ = folders
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (6, 11, 9, 4)]
    loras = ["a", "b", None, "a"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    config = dict(model=str(root / "base"), dtype="float32", num_pages=64, page_size=4, enable_lora=True)
    config.update(lora_modules=(("a", str(root / "a")), ("b", str(root / "b"))), max_loras=2)

    def run(engine: Engine) -> list[list[int]]:
        return [r.token_ids[0] for r in engine.generate(prompts, params, loras=loras)]

    want = run(Engine(EngineConfig(**config)))
    engine = Engine(EngineConfig(**config, tensor_parallel_size=2))
    try:
        got = run(engine)
    finally:
        engine.close()
        torch.distributed.destroy_process_group()
    assert got == want
    assert want[0] != want[3] or prompts[0] != prompts[3]
