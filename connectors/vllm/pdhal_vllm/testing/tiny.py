"""A tiny Llama built on the spot, for tests and the benchmark: no hub, no network.

`build(path)` writes a Hugging Face model folder (config, safetensors weights from a fixed
seed, a byte-level BPE tokenizer trained on a few fixed strings) that `vllm.LLM(path)` loads
on vLLM's CPU build. The same arguments give the same bytes on any machine with the same
torch and tokenizers. Sizes respect the CPU attention backend: head size 32, 64, 80 or more,
and the engine's block size a multiple of 32.

    python -m pdhal_vllm.testing.tiny DIR [--layers N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

#: What the tokenizer is trained on; any fixed text will do.
_TEXTS = [
    "prefill and decode run on different machines, and the cache moves between them",
    "each layer of the key value cache is shipped as soon as it is written",
    "the quick brown fox jumps over the lazy dog",
    "a messager waits for a signal, reads the blocks and writes them to the decoder",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?-",
]

VOCAB = 1000


def spec(layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int = 4) -> dict:
    """The model's shape; its hash names the folder, so a change rebuilds it."""
    return {
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "vocab": VOCAB,
        "version": 1,
    }


def build(path: str, layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int = 4) -> str:
    """Write the model into `path` (created) unless it is there already; returns `path`."""
    shape = spec(layers, hidden, heads, kv_heads)
    stamp = os.path.join(path, "pdhal-tiny.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == shape:
                return path
    os.makedirs(path, exist_ok=True)
    _tokenizer(path)
    _model(path, layers, hidden, heads, kv_heads)
    with open(stamp, "w") as f:
        json.dump(shape, f)
    return path


def cached(root: str, layers: int = 2, **kw) -> str:
    """The model folder under `root` for these sizes, built on first use."""
    shape = spec(layers, **kw)
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12]
    return build(os.path.join(root, f"tiny-llama-{digest}"), layers, **kw)


def _tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TEXTS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


def _model(path: str, layers: int, hidden: int, heads: int, kv_heads: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        # wide weights: peaked logits, so greedy choices are not near-ties
        initializer_range=0.2,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pdhal_vllm.testing.tiny",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path")
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    print(build(args.path, args.layers))


if __name__ == "__main__":
    main()
