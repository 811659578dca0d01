"""The floor of the `bench throughput` workload: the least time any engine could take for it on
one GPU (or one tensor-parallel rank), counted from bytes and FLOPs, no GPU needed.

The workload is `bench.throughput_workload` (256 requests, in/out lengths uniform in [100,
1024], the same seed). The count assumes the best case: every request admitted at once (the
3B's 256 x 2,048 tokens of K/V are 30 GB), every prompt prefilled first, then one decode step
per output position t over the requests still generating (output length > t), each at context
in + t. Per step or phase, at tensor parallel size `tp` per rank (a rank's share of the
weights, FLOPs and KV heads; all-reduces not counted):

- prefill: 2 x (layer parameters x prompt tokens + LM head x prompts) FLOPs, plus causal
  attention's 2 x 2 x layers x q_heads x head_dim x n^2 / 2 per prompt of n tokens, at the
  matmul peak;
- decode step: the matmuls max(weight bytes / bandwidth, 2 x parameters x batch / peak), then
  attention's K/V bytes of every active sequence / bandwidth.

Bandwidth and peak default to this H200's measured 4.24 TB/s device copy and 793 TFLOP/s bf16
matmul. Prints the floor in seconds and output tokens/s, and the fraction of it that measured
throughputs reach (`--measured`, out tok/s).

    PYTHONPATH=src python3 benchmarks/throughput_floor.py [--model llama-3.2-3b] [--tp 1]
        [--measured 16779,16514]
"""

from __future__ import annotations

import argparse

from llm_inference.entrypoints.bench import SHAPES, VOCAB, step_bytes, throughput_workload


def floor(config: dict, tp: int, bandwidth: float, peak: float) -> dict:
    prompts, params = throughput_workload()
    ins = [len(p) for p in prompts]
    outs = [p.max_tokens for p in params]
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    hd = config["head_dim"]
    weight_bytes = step_bytes(config, 0, 0, tp)
    head_params = VOCAB * h / tp
    # step_bytes counts the LM head once when tied to the embedding, else both tables.
    layer_params = weight_bytes / 2 - (1 if config["tie_word_embeddings"] else 2) * head_params
    kv_per_token = step_bytes(config, 1, 1, tp) - weight_bytes
    q_dim = config["num_attention_heads"] * hd / tp
    prefill_flops = 2 * (layer_params * sum(ins) + head_params * len(ins))
    prefill_flops += sum(2 * 2 * layers * q_dim * n * n / 2 for n in ins)
    matmul_s = attention_s = 0.0
    for t in range(max(outs)):
        active = [i for i, o in enumerate(outs) if o > t]
        flops = 2 * (layer_params + head_params) * len(active)
        matmul_s += max(weight_bytes / bandwidth, flops / peak)
        attention_s += sum(ins[i] + t for i in active) * kv_per_token / bandwidth
    prefill_s = prefill_flops / peak
    total = prefill_s + matmul_s + attention_s
    return {
        "prefill_s": prefill_s,
        "decode_matmul_s": matmul_s,
        "decode_attention_s": attention_s,
        "floor_s": total,
        "output_tokens": sum(outs),
        "floor_out_tok_per_s": sum(outs) / total,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.2-3b", choices=list(SHAPES))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--bandwidth", type=float, default=4.24e12, help="bytes/s")
    p.add_argument("--peak", type=float, default=793e12, help="matmul FLOP/s")
    p.add_argument("--measured", default="", help="comma-separated out tok/s to compare")
    args = p.parse_args()
    config = {**SHAPES[args.model], "vocab_size": VOCAB}
    r = floor(config, args.tp, args.bandwidth, args.peak)
    print(f"{args.model}, TP={args.tp}: floor {r['floor_s']:.2f} s = prefill "
          f"{r['prefill_s']:.2f} + decode matmuls {r['decode_matmul_s']:.2f} + decode attention "
          f"{r['decode_attention_s']:.2f}; {r['output_tokens']:,} output tokens: "
          f"{r['floor_out_tok_per_s']:,.0f} out tok/s at the floor")  # fmt: skip
    for m in [float(x) for x in args.measured.split(",") if x]:
        print(f"  {m:,.0f} out tok/s = {m / r['floor_out_tok_per_s']:.0%} of the floor")


if __name__ == "__main__":
    main()
