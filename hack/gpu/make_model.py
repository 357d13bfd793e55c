"""Builds an offline model folder for `vllm serve --load-format dummy`: a Qwen3-shaped config.json
(Qwen3ForCausalLM in bf16, the layer sizes of Qwen3-0.6B, -1.7B, -4B or -8B) and a WordLevel tokenizer
over the whole 151936-entry vocabulary ("w<id>" words, whitespace split), so that a prompt of N random
words is exactly N tokens (disagg-localrun's load generator sends such prompts).

    python hack/gpu/make_model.py OUTDIR [SHAPE]     # SHAPE: qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b (default)

Needs only `tokenizers` (no network, no weights)."""
import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

VOCAB = 151936
SPECIAL = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36,
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": VOCAB,
}


# Layer sizes of the published Qwen3 dense models (their config.json); the rest is CONFIG's.
SHAPES = {
    "qwen3-0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "max_window_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "max_window_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-4b": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "max_window_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-8b": {},
}


def config(shape: str) -> dict:
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}: choose from {', '.join(SHAPES)}")
    return {**CONFIG, **SHAPES[shape]}


def kv_bytes_per_token(cfg: dict) -> int:
    """K and V of every layer, bf16."""
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2


def main(out: str, shape: str = "qwen3-8b") -> None:
    cfg = config(shape)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 151643, "eos_token_id": 151645, "do_sample": False}, f)
    vocab = {SPECIAL.get(i, f"w{i}"): i for i in range(VOCAB)}
    vocab["[UNK]"] = vocab.pop("w0")  # id 0 doubles as the unknown token
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens(list(SPECIAL.values()))
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]",
                   "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "model_max_length": 40960, "clean_up_tokenization_spaces": False,
                   # chat requests (localrun migrate --chat): the messages' words, then the answer's
                   "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}, f, indent=2)
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "[UNK]"}, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
    print(f"{sys.argv[1]}: {sys.argv[2] if len(sys.argv) > 2 else 'qwen3-8b'} shape, "
          f"{kv_bytes_per_token(config(sys.argv[2] if len(sys.argv) > 2 else 'qwen3-8b'))} KV bytes per token")
