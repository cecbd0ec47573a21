"""A GGUF target's tokenizer with the GGUF's own special tokens.

transformers builds a GGUF file's tokenizer from its header, but for byte-level BPE vocabularies (`tokenizer.ggml.model`
"gpt2": Qwen2, DeepSeek-R1's Qwen distills, SmolLM2) its converter ignores the header's token types and special ids:
for Qwen2 it adds `<|endoftext|>`, `<|im_start|>` and `<|im_end|>` whatever the file holds (new ids past the vocabulary
where the file names them otherwise) and leaves the file's control tokens (`<｜User｜>`, `<|fim_prefix|>`, ...) as
ordinary vocabulary entries that text never tokenizes to, so a chat template's markers split into pieces and the end
of a turn is never seen. fix_tokenizer puts back what the file says: control tokens (type 3) as special added tokens
and user-defined ones (type 4: `<think>`, `</think>`, ...) as non-special ones, each with its id in the file; added
tokens the file does not hold are dropped; bos, eos and padding are the file's ids. A tokenizer that already agrees
with the file is returned as it is.
"""
from __future__ import annotations

import json
from pathlib import Path

CONTROL, USER_DEFINED = 3, 4  # GGUF token types (llama.cpp's LLAMA_TOKEN_TYPE_*)
SPECIAL_IDS = ("bos", "eos", "padding")


def read_vocab(gguf: Path) -> dict | None:
    """The GGUF's byte-level BPE vocabulary: {"tokens": [str], "types": [int], "bos"/"eos"/"padding": id where given};
    None for another tokenizer model (SentencePiece's "llama", which transformers converts with its token types)."""
    from gguf import GGUFReader

    f = GGUFReader(str(gguf)).fields
    model = f.get("tokenizer.ggml.model")
    if model is None or bytes(model.parts[-1]).decode("utf-8") != "gpt2" or "tokenizer.ggml.token_type" not in f:
        return None
    tok, typ = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"]
    vocab = {"tokens": [bytes(tok.parts[i]).decode("utf-8") for i in tok.data],
             "types": [int(typ.parts[i][0]) for i in typ.data]}
    for k in SPECIAL_IDS:
        field = f.get(f"tokenizer.ggml.{k}_token_id")
        if field is not None:
            vocab[k] = int(field.parts[-1][0])
    return vocab


def fix_tokenizer(tok, gguf: Path):
    """`tok` (transformers' tokenizer of the GGUF file `gguf`) with the file's special tokens and ids (module
    docstring); `tok` itself where it already agrees with the file or the file's vocabulary is not byte-level BPE."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    vocab = read_vocab(gguf)
    if vocab is None or not getattr(tok, "is_fast", False):
        return tok
    tokens, types = vocab["tokens"], vocab["types"]
    data = json.loads(tok.backend_tokenizer.to_str())
    wanted = {i: types[i] == CONTROL for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)}
    names = {k: tokens[vocab[k]] for k in SPECIAL_IDS if 0 <= vocab.get(k, -1) < len(tokens)}
    # the added tokens the file holds, each special as its type says; then those of its control and user-defined
    # tokens that are missing
    keep = [{**a, "special": wanted.get(a["id"], a["special"])} for a in data["added_tokens"]
            if a["id"] < len(tokens) and tokens[a["id"]] == a["content"]]
    kept = {a["id"] for a in keep}
    keep += [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": special} for i, special in wanted.items() if i not in kept]
    keep.sort(key=lambda a: a["id"])
    have = {"bos": tok.bos_token, "eos": tok.eos_token, "padding": tok.pad_token}
    if keep == sorted(data["added_tokens"], key=lambda a: a["id"]) and all(have[k] == n for k, n in names.items()):
        return tok
    data["added_tokens"] = keep
    fixed = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)),
                                    bos_token=names.get("bos"), eos_token=names.get("eos"),
                                    pad_token=names.get("padding"))
    fixed.chat_template = tok.chat_template
    fixed.model_max_length = tok.model_max_length
    # saved as None too: reloaded as the model type's tokenizer class (Qwen2Tokenizer), a missing unk_token takes
    # that class's default, `<|endoftext|>`, which is added as a new id where the file does not hold it
    unk = tok.unk_token_id
    fixed.init_kwargs["unk_token"] = tok.unk_token if unk is not None and unk < len(tokens) and \
        tokens[unk] == tok.unk_token else None
    return fixed
