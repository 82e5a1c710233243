"""Write the tiny random-weight Llama (config + tokenizer) and LoRA adapters for vLLM tests.

Runs inside the vLLM virtual environment (it has ``tokenizers``, ``torch`` and ``safetensors``).
The tokenizer is a small byte-level BPE trained here on fixed text, so it is identical on every
machine; weights are filled by vLLM itself (``--load-format dummy``). Usage:

    python vllm_assets.py model DIR      # config.json, tokenizer.json, tokenizer_config.json, ...
    python vllm_assets.py adapter DIR    # adapter_config.json + adapter_model.safetensors
"""

from __future__ import annotations

import json
import os
import sys

HIDDEN = 128
LAYERS = 2
CORPUS = [
    "the quick brown fox jumps over the lazy dog " * 4,
    "KV cache aware routing sends requests to the worker holding the longest prefix.",
    "hello world, this is a tiny tokenizer trained locally for a random weight model.",
    "You are a helpful assistant. Answer the question using the context below.",
]
# A minimal chat template so /v1/chat/completions and server-side prompt_text work too.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _dump(path: str, obj: object) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)


def write_model(out: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    os.makedirs(out, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 50, trainer)
    tok.save(os.path.join(out, "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    _dump(
        os.path.join(out, "tokenizer_config.json"),
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "model_max_length": 2048,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _dump(os.path.join(out, "special_tokens_map.json"), special)
    _dump(
        os.path.join(out, "config.json"),
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": tok.get_vocab_size(),
            "hidden_size": HIDDEN,
            "intermediate_size": 2 * HIDDEN,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 64,  # the CPU attention backend rejects head_dim 16
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
        },
    )
    _dump(
        os.path.join(out, "generation_config.json"),
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
    )


def write_adapter(out: str, rank: int = 8) -> None:
    import torch
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    gen = torch.Generator().manual_seed(sum(map(ord, os.path.basename(out))))
    tensors = {}
    for layer in range(LAYERS):
        for proj in ("q_proj", "v_proj"):
            base = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            a = torch.randn(rank, HIDDEN, generator=gen) * 0.01
            b = torch.randn(HIDDEN, rank, generator=gen) * 0.01
            tensors[base + ".lora_A.weight"] = a.to(torch.bfloat16)
            tensors[base + ".lora_B.weight"] = b.to(torch.bfloat16)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    _dump(
        os.path.join(out, "adapter_config.json"),
        {
            "base_model_name_or_path": "tiny",
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": 16,
            "target_modules": ["q_proj", "v_proj"],
            "lora_dropout": 0.0,
            "bias": "none",
            "task_type": "CAUSAL_LM",
            "fan_in_fan_out": False,
            "inference_mode": True,
        },
    )


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("model", "adapter"):
        sys.exit("usage: vllm_assets.py (model|adapter) DIR")
    (write_model if sys.argv[1] == "model" else write_adapter)(sys.argv[2])
