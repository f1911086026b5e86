"""A random-weight Hugging Face checkpoint of a named shape, with a tokenizer that covers its
whole vocabulary, for servers compared on a machine without the real model (no model hub).

Writes ``OUT/model.safetensors`` (``AutoModelForCausalLM.from_config`` of
:func:`model_shapes.shape_config`, float32, ``--seed``), the config, and a word-level tokenizer
of the shape's ``vocab_size`` tokens: id 0 ``<|endoftext|>`` (unk, pad), 1 ``<|im_start|>`` (bos),
2 ``<|im_end|>`` (eos), every other id ``i`` the word ``w<i>``, words joined by spaces. Every id
decodes to non-empty text, so a server streaming random token ids sends one chunk per token
(the tests' tiny BPE tokenizer has ~330 tokens: vLLM sends no chunk for ids past it, and its
TTFT / ITL then measure the wait for a decodable token). Both rlserve and vLLM load it as they
would the real model (SmolLM2-135M-Instruct's shapes and per-token work with
``--shape smollm2-135m``, the default).

Usage:
    python benchmarks/random_checkpoint.py --out /tmp/smollm2-135m-random
    python benchmarks/cpu_vs_vllm.py --issue37 --model /tmp/smollm2-135m-random --vllm-python /work/vvenv/bin/python
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from model_shapes import shape_config  # noqa: E402

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2


def word_tokenizer(vocab_size: int):
    """A ``PreTrainedTokenizerFast`` of ``vocab_size`` ids (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=SPECIALS[0], pad_token=SPECIALS[0],
                                   bos_token=SPECIALS[1], eos_token=SPECIALS[2])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--shape", default="smollm2-135m", help="a name of benchmarks/model_shapes.py")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    cfg = shape_config(args.shape)
    cfg.bos_token_id, cfg.eos_token_id = 1, 2
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(args.out)
    word_tokenizer(cfg.vocab_size).save_pretrained(args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
