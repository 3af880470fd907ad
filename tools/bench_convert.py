#!/usr/bin/env python
"""Conversion cost: wall time and peak resident memory of HF -> Megatron conversion and back, each run
in its own process, for SmolLM2 and for a larger synthetic Llama written shard by shard (never whole
in memory). Peak RSS is compared with the size of the weights: a streaming converter stays near one
output shard plus one tensor, not the whole model (the export back: near one HF shard,
``--max-shard-mb``). The export reads the checkpoint memory-mapped, whose pages count in RSS as they
are read but are page cache (reclaimable): peak anonymous memory (RssAnon, sampled every 5 ms) is
what it needs.

    python tools/bench_convert.py --out bench_convert.json [--synthetic-layers 16 --synthetic-hidden 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MEASURED = r"""
import sys, time, resource, json, threading, warnings
warnings.filterwarnings("ignore")
from pathlib import Path
from specroll_mcore.checkpoint import convert
src, out, a, b = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
peak_anon = [0]
def sample_anon():  # resident anonymous memory (mapped checkpoint pages are page cache, reclaimable)
    while True:
        try:
            for line in open("/proc/self/status"):
                if line.startswith("RssAnon:"):
                    peak_anon[0] = max(peak_anon[0], int(line.split()[1]))
        except OSError:
            return
        time.sleep(0.005)
threading.Thread(target=sample_anon, daemon=True).start()
t0 = time.perf_counter()
%s
print(json.dumps({"seconds": time.perf_counter() - t0,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "peak_anon_mb": peak_anon[0] / 1024,
                  "files": sorted(p.name for p in Path(out).glob("*.safetensors"))}))
"""
CHILD = MEASURED % "convert.convert_hf_to_mcore(Path(src), Path(out), a, b)"  # a, b: TP, PP
CHILD_EXPORT = MEASURED % """try:  # a: the shard size in MB
    convert.convert_mcore_to_hf(Path(src), Path(out), max_shard_bytes=a * 2**20)
except TypeError:  # (a version without sharded export)
    convert.convert_mcore_to_hf(Path(src), Path(out))"""


def write_synthetic_llama(path: Path, layers: int, hidden: int, ffn: int, vocab: int, heads: int, kv_heads: int) -> int:
    """A random bf16 Llama in safetensors shards of one layer each; returns its size in bytes."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    d = hidden // heads
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (0.02 * torch.randn(*shape, generator=g)).to(torch.bfloat16)

    weight_map, total = {}, 0

    def emit(name: str, tensors: dict) -> None:
        nonlocal total
        save_file(tensors, str(path / name))
        for k, v in tensors.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()

    emit("embed.safetensors", {"model.embed_tokens.weight": rnd(vocab, hidden)})
    for i in range(layers):
        p = f"model.layers.{i}."
        emit(f"layer{i:03d}.safetensors", {
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": rnd(heads * d, hidden),
            p + "self_attn.k_proj.weight": rnd(kv_heads * d, hidden),
            p + "self_attn.v_proj.weight": rnd(kv_heads * d, hidden),
            p + "self_attn.o_proj.weight": rnd(hidden, heads * d),
            p + "mlp.gate_proj.weight": rnd(ffn, hidden), p + "mlp.up_proj.weight": rnd(ffn, hidden),
            p + "mlp.down_proj.weight": rnd(hidden, ffn)})
    emit("head.safetensors", {"model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                              "lm_head.weight": rnd(vocab, hidden)})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                    "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden, "intermediate_size": ffn,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "vocab_size": vocab, "max_position_embeddings": 4096, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False}))
    return total


def run_child(src: Path, out: Path, *args: int, code: str = CHILD) -> dict:
    proc = subprocess.run([sys.executable, "-c", code, str(src), str(out), *map(str, args)],
                          capture_output=True, text=True, env=dict(os.environ))
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_convert.json")
    ap.add_argument("--synthetic-layers", type=int, default=16)
    ap.add_argument("--synthetic-hidden", type=int, default=2048)
    ap.add_argument("--synthetic-ffn", type=int, default=5632)
    ap.add_argument("--synthetic-vocab", type=int, default=32000)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2, help="the export's source is also converted at this PP size")
    ap.add_argument("--max-shard-mb", type=int, default=512, help="HF shard size of the export")
    args = ap.parse_args()
    from specroll_mcore.checkpoint.smollm2 import default_hf_dir

    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        smol = default_hf_dir()
        size = sum(f.stat().st_size for f in smol.glob("*.safetensors"))
        r = run_child(smol, tmp / "smol-mcore", 1, 1)
        report["smollm2"] = {"weights_mb": size / 2**20, **r}
        print(f"SmolLM2 (float32, {size / 2**20:.0f} MB): {r['seconds']:.1f} s, peak RSS {r['peak_rss_mb']:.0f} MB")
        t0 = time.perf_counter()
        size = write_synthetic_llama(tmp / "synth", args.synthetic_layers, args.synthetic_hidden, args.synthetic_ffn,
                                     args.synthetic_vocab, heads=16, kv_heads=8)
        print(f"synthetic Llama written ({size / 2**20:.0f} MB bf16) in {time.perf_counter() - t0:.1f} s")
        for tp in sorted({1, args.tp}):
            r = run_child(tmp / "synth", tmp / f"synth-mcore-tp{tp}", tp, 1)
            report[f"synthetic_tp{tp}"] = {"weights_mb": size / 2**20, "layers": args.synthetic_layers,
                                           "hidden": args.synthetic_hidden, **r}
            print(f"synthetic -> TP={tp}: {r['seconds']:.1f} s, peak RSS {r['peak_rss_mb']:.0f} MB "
                  f"({r['peak_rss_mb'] / (size / 2**20):.2f} x the weights)")
        run_child(tmp / "synth", tmp / f"synth-mcore-pp{args.pp}", 1, args.pp)
        for name in (f"tp{max(1, args.tp)}", f"pp{args.pp}"):
            r = run_child(tmp / f"synth-mcore-{name}", tmp / f"synth-back-{name}", args.max_shard_mb, 0,
                          code=CHILD_EXPORT)
            shutil.rmtree(tmp / f"synth-back-{name}")
            report[f"export_{name}"] = {"weights_mb": size / 2**20, "max_shard_mb": args.max_shard_mb, **r}
            print(f"synthetic {name.upper()} -> HF: {r['seconds']:.1f} s, peak RSS {r['peak_rss_mb']:.0f} MB "
                  f"({r['peak_rss_mb'] / (size / 2**20):.2f} x the weights; anonymous {r['peak_anon_mb']:.0f} MB, "
                  f"{r['peak_anon_mb'] / (size / 2**20):.2f} x), {len(r['files'])} file(s)")
    from specroll_mcore.checkpoint.megatron import write_json_atomic  # (the children are measured by now)

    write_json_atomic(Path(args.out), report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
