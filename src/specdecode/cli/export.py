"""`specdecode export`: take a trained EAGLE-3 drafter to vLLM or SGLang."""

from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    e = sub.add_parser(
        "export",
        help="write an EAGLE-3 drafter in the checkpoint layout vLLM / SGLang load",
        description="Write the EAGLE-3 drafter in --heads (from train-heads --method eagle3) to --out in the "
        "layout vLLM's and SGLang's llama_eagle3 loaders read: config.json (LlamaForCausalLMEagle3, "
        "draft_vocab_size, target_hidden_size, eagle_aux_hidden_state_layer_ids) and model.safetensors "
        "(fc, midlayer.*, norm, lm_head, d2t, t2d, and the target's embed_tokens), then read it back and "
        "check every name and shape. Serve it with e.g. vllm serve TARGET --speculative-config "
        '\'{"method": "eagle3", "model": "OUT", "num_speculative_tokens": 4}\'.',
    )
    e.add_argument(
        "--heads", required=True, metavar="DIR", help="the drafter (e.g. models/smollm2-135m/eagle3)"
    )
    e.add_argument("--format", required=True, choices=("vllm", "sglang"))
    e.add_argument("--out", required=True, metavar="DIR")
    e.add_argument(
        "--no-embeddings", action="store_true", help="leave out embed_tokens (the engine shares the target's)"
    )
    e.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from ..train.export import check_checkpoint, export

    out = export(args.heads, args.format, args.out, embeddings=not args.no_embeddings)
    cfg = check_checkpoint(out)
    print(
        f"wrote {out} for {args.format}: draft vocabulary {cfg['draft_vocab_size']} of {cfg['vocab_size']}, "
        f"aux layers {cfg['eagle_aux_hidden_state_layer_ids']}; checked against the loader's layout",
        file=sys.stderr,
    )
    return 0
