"""Writes a tiny random-weight Llama, its tokenizer and a chat template into a
folder, for real vLLM engines without a model hub (docs/vllm.md).

    python scripts/vllm/make_model.py OUT_DIR [--corpus FILE ...]

The tokenizer is a word-level vocabulary built from the corpus (the
repository's Markdown files by default), with a whitespace pre-tokenizer and
a decoder that joins tokens with single spaces. That makes decode -> encode
an identity on any generated token sequence, which multi-turn reuse needs:
vLLM's decode engine returns `remote_num_tokens` = prompt + generated - 1
and the prefill engine READs that many positions, so the next turn's prompt
must re-tokenize the previous answer into exactly the ids D generated. A BPE
(byte-level) tokenizer does not guarantee that for random output.

The model: LlamaConfig(hidden 256, intermediate 512, 2 layers, 4 heads,
2 KV heads, head_dim 64) as in the measured recipe (head_dim 16 is refused by
vLLM's CPU attention backend); weights drawn with a larger initializer range
(0.2) than Llama's 0.02 so that outputs depend strongly on the context, which
makes a READ of wrong KV blocks visible in the logprobs. Seeded: the same
folder every time.
"""

import argparse
import collections
import json
import pathlib
import re
import sys

EOS = "</s>"
# WordLevel needs an unknown token; it is a plain word here, not a special
# token (a special one would be dropped by decode and break the round trip).
UNK = "unk"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | upper }} : {{ m['content'] }} END "
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT :{% endif %}"
)
WORD = re.compile(r"\w+|[^\w\s]+")


def vocab_from(files, size):
    counts = collections.Counter()
    for f in files:
        try:
            counts.update(WORD.findall(pathlib.Path(f).read_text(errors="ignore")))
        except OSError:
            continue
    words = [EOS, UNK, "USER", "ASSISTANT", "SYSTEM", "END", ":"]
    for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(words) >= size:
            break
        if w not in words and len(w) <= 24 and w.isascii():
            words.append(w)
    return {w: i for i, w in enumerate(words)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--corpus", nargs="*")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=17)
    a = ap.parse_args()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    root = pathlib.Path(__file__).resolve().parents[2]
    # A frozen corpus: editing the docs must not change the random model
    # (its calibration depends on it).
    corpus = a.corpus or [str(root / "tests/vllm/corpus.md")]

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = vocab_from(corpus, a.vocab_size)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="\u0000##", cleanup=False)
    tok.add_special_tokens([EOS])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "unk_token": None,
                "bos_token": None,
                "pad_token": EOS,
                "model_max_length": 4096,
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=1,
        )
    )
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": EOS}))

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(a.seed)
    cfg = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=vocab[EOS],
        pad_token_id=vocab[EOS],
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": vocab[EOS]}))
    print(json.dumps({"model": str(out), "vocab": len(vocab), "eos": vocab[EOS]}))


if __name__ == "__main__":
    sys.exit(main())
