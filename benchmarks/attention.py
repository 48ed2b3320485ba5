"""Attention in the shards' bf16 encodes: the native kernel against torch, on one thread.

In ONE run, on this machine:

1. **Attention alone.** ``kernels.attention.attention`` (``native/attention_bf16.c``) against
   torch's ``scaled_dot_product_attention`` (CPU flash attention; what transformers' sdpa
   runs) and the eager bf16 path (matmul, softmax, matmul: transformers' ``eager``), on q,
   k, v laid out as a transformer makes them, with a padding mask: MiniLM heads (12 x 32) and
   BERT-base heads (12 x 64), 112 positions, batches 16 and 64. Interleaved, repeated;
   GFLOP/s = 4 B H W^2 D over the median time.
2. **Its share of an encode.** torch.profiler over MiniLM's bf16 forward (random token ids,
   112 positions, batch 16, inference): the share of the CPU time in the attention op, with
   transformers' sdpa and with the kernel.
3. **Batch size.** Entities/s of MiniLM's bf16 encode with the kernel at several batch sizes
   (the same 256 sequences of 112 tokens), interleaved: what ``service.encode_batch_size``
   to use on a CPU.

Prints tables and writes benchmarks/results/attention.json.

    .venv/bin/python -m benchmarks.attention      # ~2 minutes here
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F


from benchmarks.common import (add_hygiene_args, gemm_peaks, interleaved, load_guard, machine_info,  # noqa: E402
                               print_table, save_results)
from dist_nce.cluster.runtime import configure_process  # noqa: E402


def qkv(B: int, H: int, W: int, D: int, seed: int = 0):
    """q, k, v [B, H, W, D] bf16, views of one [B, W, 3, H, D] projection; a padding mask
    (lengths between 0.8 W and W, as in a length-sorted batch)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, W, 3, H, D, generator=g).bfloat16()
    lengths = torch.randint(int(0.8 * W), W + 1, (B,), generator=g)
    mask = (torch.arange(W)[None, :] < lengths[:, None])[:, None, None, :]
    return (*(x[:, :, i].transpose(1, 2) for i in range(3)), mask)


def eager_attention(q, k, v, mask):
    """transformers' eager path in bf16: scores, additive mask, softmax, values."""
    s = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.matmul(s, v)


def attention_alone(shapes, repeats: int) -> list[dict]:
    from dist_nce.kernels.attention import attention

    rows = []
    for label, (B, H, W, D) in shapes.items():
        q, k, v, mask = qkv(B, H, W, D)
        flops = 4.0 * B * H * W * W * D
        # name -> (call, whether its output is [B, H, W, D] rather than the kernel's [B, W, H, D])
        methods = {"native kernel": (lambda: attention(q, k, v, mask), False),
                   "torch sdpa (CPU flash)": (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), True),
                   "eager bf16 (matmul, softmax, matmul)": (lambda: eager_attention(q, k, v, mask), True)}
        want = eager_attention(q.float(), k.float(), v.float(), mask).transpose(1, 2)
        got = {name: (fn().transpose(1, 2) if by_head else fn()).float() for name, (fn, by_head) in methods.items()}
        times = interleaved({name: fn for name, (fn, _) in methods.items()}, repeats)
        base = times["torch sdpa (CPU flash)"]["median"]
        for name, t in times.items():
            rows.append({"shape": label, "B": B, "H": H, "W": W, "D": D, "method": name, **t,
                         "gflops": flops / t["median"] / 1e9, "x_sdpa_speed": base / t["median"],
                         "max_abs_diff_vs_fp32": float((got[name] - want).abs().max())})
    return rows


def minilm(model_dir: str):
    from dist_nce.modeling.encoder import Encoder
    from dist_nce.modeling.retriever import EntityEncoder, RetrieverConfig

    config = RetrieverConfig(preset="dual", mention_model=model_dir, storage_dtype="float32")
    return EntityEncoder(Encoder.from_pretrained(model_dir), config.spec(), config.trim_padding).eval()


def tokens(n: int, W: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 29000, (n, W), generator=g)
    ids[:, 0] = 101
    lengths = torch.randint(int(0.8 * W), W + 1, (n,), generator=g)
    return ids, torch.arange(W)[None, :] < lengths[:, None]


def encode(encoder, ids, real, batch: int) -> None:
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        for a in range(0, len(ids), batch):
            encoder(ids[a:a + batch], real[a:a + batch])


def attention_share(encoders: dict, W: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    ids, real = tokens(32, W)
    rows = []
    for name, (encoder, op) in encoders.items():
        encode(encoder, ids, real, 16)  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            encode(encoder, ids, real, 16)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        att = sum(e.self_cpu_time_total for e in events if op in e.key)
        rows.append({"attention": name, "op": op, "attention_share": att / total, "total_ms": total / 1e3})
    return rows


def batch_sweep(encoder, sizes: list[int], W: int, repeats: int) -> list[dict]:
    ids, real = tokens(256, W)
    times = interleaved({str(b): (lambda b=b: encode(encoder, ids, real, b)) for b in sizes}, repeats)
    return [{"batch": int(b), **t, "entities_per_s": len(ids) / t["median"]} for b, t in times.items()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--width", type=int, default=112, help="positions per sequence (KILT entities: 110 on average)")
    ap.add_argument("--batches", default="8,16,32,64,128", help="batch sizes of the encode sweep")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/attention.json)")
    add_hygiene_args(ap)
    args = ap.parse_args(argv)
    configure_process(threads=1)
    guard = load_guard(args.force)
    from dist_nce.core.models import default_model_dir
    from dist_nce.kernels.attention import unavailable_reason, use_native_attention

    why = unavailable_reason()
    if why is not None:
        raise SystemExit(f"native attention unavailable here: {why}")
    peak = gemm_peaks(1)
    W = args.width
    shapes = {"MiniLM heads, batch 16": (16, 12, W, 32), "MiniLM heads, batch 64": (64, 12, W, 32),
              "BERT-base heads, batch 16": (16, 12, W, 64)}
    alone = attention_alone(shapes, args.repeats)
    print(f"\nattention alone, 1 thread, {W} positions (bf16 GEMM peak {peak['bf16']:.0f} GFLOP/s)")
    print_table(alone, [("shape", "shape", "<26s"), ("method", "method", "<38s"), ("median", "median s", ">9.5f"),
                        ("min", "min", ">8.5f"), ("max", "max", ">8.5f"), ("gflops", "GFLOP/s", ">8.0f"),
                        ("x_sdpa_speed", "x sdpa", ">7.2f"), ("max_abs_diff_vs_fp32", "vs fp32", ">8.4f")])

    sdpa = minilm(default_model_dir())
    native = copy.deepcopy(sdpa)
    use_native_attention(native, required=True)
    share = attention_share({"sdpa": (sdpa, "scaled_dot_product"), "native kernel": (native, "bf16_attention")}, W)
    print(f"\nshare of a MiniLM bf16 encode's CPU time in attention (batch 16, {W} positions)")
    print_table(share, [("attention", "attention", "<14s"), ("attention_share", "share", ">6.2f"),
                        ("total_ms", "total ms", ">9.0f")])

    sizes = [int(b) for b in args.batches.split(",")]
    sweep = batch_sweep(native, sizes, W, max(3, args.repeats // 2))
    print(f"\nMiniLM bf16 encode with the kernel, 256 sequences of {W} positions, by batch size")
    print_table(sweep, [("batch", "batch", ">5d"), ("entities_per_s", "ent/s", ">7.1f"), ("min", "min s", ">7.3f"),
                        ("median", "median s", ">8.3f"), ("max", "max s", ">7.3f")])
    out = save_results("attention", {
        **guard, "benchmark": "attention", "width": W, "repeats": args.repeats, "gemm_gflops": peak,
        "alone": alone, "share": share, "batch_sweep": sweep, "model": "all-MiniLM-L6-v2",
        "machine": machine_info(threads=1)}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
