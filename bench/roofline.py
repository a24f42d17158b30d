"""The hardware's ceiling for a batch of generation requests: what no engine can beat on this model and GPU.

For `num_requests` requests of `prompt_len` + `output_len` tokens run `concurrency` at a time (waves of equal
requests), the run takes at least
- memory: every decode step reads the weights once (all but the input embedding, of which it reads a row per
  token; the output projection in full, tied or not) and each running sequence's KV cache so far;
- compute: 2 FLOPs per weight per token (prompt and output tokens, the output projection included) plus
  attention: 4 x head_dim x context per head, layer and token (QK^T and AV);
and the roofline is the larger of the two times. Its output tokens/s is what the measured figure is a
percentage of. Llama-style shapes (GQA, gated MLP) from config.json; H200 defaults: 4.8 TB/s HBM, 989 TFLOP/s
dense bfloat16.

    python3 bench/roofline.py bench/models/llama-3.1-8b --num-requests 256 --prompt-len 128 --output-len 128
"""
from __future__ import annotations

import argparse
import json
import math
import os

H200_BANDWIDTH = 4.8e12  # bytes/s
H200_BF16_FLOPS = 989e12  # dense
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def model_shape(config: dict) -> dict:
    config = config.get("text_config") or config
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    per_layer = (hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden  # q, k, v, o
                 + 3 * hidden * config["intermediate_size"] + 2 * hidden)  # gated MLP, two norms
    return {
        "layers": layers, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
        "matmul_params": layers * per_layer + hidden * vocab,  # what each token multiplies: the output projection too
        "kv_values_per_token": 2 * layers * kv_heads * head_dim,
        "params": layers * per_layer + hidden + vocab * hidden * (1 if config.get("tie_word_embeddings") else 2),
    }


def roofline(config: dict, dtype: str, num_requests: int, prompt_len: int, output_len: int, concurrency: int,
             bandwidth: float = H200_BANDWIDTH, flops: float = H200_BF16_FLOPS) -> dict:
    shape = model_shape(config)
    width = DTYPE_BYTES[dtype]
    waves = math.ceil(num_requests / max(1, concurrency))
    steps = waves * output_len
    tokens = num_requests * (prompt_len + output_len)
    # Sum over every output token of the context it attends to (and reads the KV cache of).
    decode_context = num_requests * (output_len * prompt_len + output_len * (output_len - 1) / 2)
    prefill_context = num_requests * prompt_len * (prompt_len + 1) / 2
    read = steps * shape["matmul_params"] * width + decode_context * shape["kv_values_per_token"] * width
    attention = 4 * shape["layers"] * shape["heads"] * shape["head_dim"] * (decode_context + prefill_context)
    compute = 2 * shape["matmul_params"] * tokens + attention
    seconds = max(read / bandwidth, compute / flops)
    return {
        "params": shape["params"], "memory_s": read / bandwidth, "compute_s": compute / flops, "seconds": seconds,
        "bound": "memory" if read / bandwidth >= compute / flops else "compute",
        "output_tokens_per_s": num_requests * output_len / seconds,
    }


def load_config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="a directory with config.json")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=None, help="default: all requests at once")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--bandwidth-tbps", type=float, default=H200_BANDWIDTH / 1e12)
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_FLOPS / 1e12)
    args = p.parse_args()
    r = roofline(load_config(args.model_dir), args.dtype, args.num_requests, args.prompt_len, args.output_len,
                 args.concurrency or args.num_requests, args.bandwidth_tbps * 1e12, args.peak_tflops * 1e12)
    print(f"{args.model_dir}: {r['params'] / 1e9:.2f}B parameters in {args.dtype}; memory {r['memory_s'] * 1e3:.1f} ms, "
          f"compute {r['compute_s'] * 1e3:.1f} ms: {r['bound']}-bound, at most {r['output_tokens_per_s']:,.0f} "
          f"output tokens/s")


if __name__ == "__main__":
    main()
