"""`pagemesh tokenizer-export DIR`: the served model's tokenizer as a Hugging Face folder.

Load tools (guidellm, aiperf, lm-eval) count tokens with `transformers.AutoTokenizer`, which wants
a hub id or a folder. The embedded model is a GGUF file, so this writes, from our own tokenizer
(common/tokenizer.py, built from the GGUF's metadata):

    DIR/tokenizer.json           the `tokenizers` model (BPE, pre-tokenizer, decoder, added tokens),
                                 with a post-processor that adds BOS when the model wants one
    DIR/tokenizer_config.json    PreTrainedTokenizerFast, the special tokens, the chat template,
                                 model_max_length
    DIR/special_tokens_map.json  bos/eos/unk/pad, those the model defines

`AutoTokenizer.from_pretrained(DIR)` then loads offline and gives the ids ours gives (the unit
test checks this over varied text and a chat-template render).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pagemesh.common.model_config import default_max_model_len
from pagemesh.common.model_files import resolve_model_path, served_model_name
from pagemesh.common.tokenizer import Tokenizer

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def hf_tokenizer_files(tokenizer: Tokenizer, model_max_length: int) -> dict[str, str]:
    """File name -> text of the Hugging Face tokenizer folder equivalent to `tokenizer`."""
    backend = json.loads(tokenizer.backend_json())
    specials = tokenizer.special_texts
    if tokenizer.add_bos:  # a fast tokenizer adds BOS through its post-processor, not a flag
        bos = specials["bos_token"]
        backend["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": bos, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [tokenizer.bos_token_id], "tokens": [bos]}},
        }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": tokenizer.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template.source
    return {
        "tokenizer.json": json.dumps(backend, ensure_ascii=False, indent=1),
        "tokenizer_config.json": json.dumps(config, ensure_ascii=False, indent=2),
        "special_tokens_map.json": json.dumps(specials, ensure_ascii=False, indent=2),
    }


def export(model: str | None, out_dir: Path, max_model_len: int | None = None) -> list[Path]:
    """Write the folder for `model` (None: the embedded one) into `out_dir`; the paths written."""
    path = resolve_model_path(model)
    files = hf_tokenizer_files(Tokenizer.from_path(path), max_model_len or default_max_model_len(path))
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        (out_dir / name).write_text(text + "\n", encoding="utf-8")
        written.append(out_dir / name)
    return written


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="pagemesh tokenizer-export",
        description="write the model's tokenizer as a Hugging Face folder (for --tokenizer of load tools)",
    )
    parser.add_argument("dir", help="folder to write (created if missing)")
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: the embedded model)")
    parser.add_argument("--max-model-len", type=int, default=None, help="model_max_length to record")
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names the mesh serves the model under (`pagemesh up --served-model-name`): the first is "
        "the one this reports (default: the model's own id)",
    )
    args = parser.parse_args(argv)
    out_dir = Path(args.dir)
    export(args.model, out_dir, args.max_model_len)
    name = (*(args.served_model_name or ()), served_model_name(resolve_model_path(args.model)))[0]
    print(f"wrote {', '.join(FILES)} of {name} to {out_dir}")
