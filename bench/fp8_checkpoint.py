"""Write a float Hugging Face checkpoint again as a pre-quantized FP8 one, in the
two formats the FP8 releases ship (``engine/model/checkpoint_quant.py``):

- ``block``: ``quant_method: fp8`` with ``weight_block_size`` (DeepSeek-V3,
  Qwen3-FP8): ``weight_scale_inv`` per block of ``--block`` x ``--block``;
- ``channel`` / ``tensor``: ``quant_method: compressed-tensors`` FP8 (the FP8
  re-releases of Llama): ``weight_scale`` per output row, or one per tensor.

Every linear of the decoder layers becomes ``float8_e4m3fn`` with its scale; the
embedding, norms and LM head stay as they were. With ``--dequantized DIR`` it also
writes the exactly dequantized float checkpoint (``weight * scale``), the
reference a loaded FP8 checkpoint must equal. Then it prints how close the FP8
checkpoint's logits are to the float model's and to the dequantized one's::

    python -m splitserve.bench.fp8_checkpoint SRC DST --format block --dequantized DEQ
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch

from splitserve.engine.model.checkpoint import checkpoint_files

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
_LINEAR = re.compile(r"layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")


def quantize(w: torch.Tensor, fmt: str, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale as the checkpoint stores it, exactly dequantized float32 weight)."""
    w = w.float()
    if fmt == "tensor":
        scale = (w.abs().max().clamp(min=1e-12) / FP8_MAX).reshape(1)
        full = scale.expand_as(w)
    elif fmt == "channel":
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        full = scale.expand_as(w)
    else:
        n, k = w.shape
        rb, cb = -(-n // block), -(-k // block)
        padded = torch.zeros(rb * block, cb * block)
        padded[:n, :k] = w
        tiles = padded.view(rb, block, cb, block)
        scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
        full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.contiguous(), q.float() * full


def quantization_config(fmt: str, block: int) -> dict:
    if fmt == "block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [block, block]}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": fmt,
                    "symmetric": True,
                    "dynamic": False,
                },
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
            }
        },
        "ignore": ["lm_head"],
    }


def write_fp8_checkpoint(
    src: Path, dst: Path, fmt: str, block: int = 128, dequantized: Path | None = None
) -> None:
    """``src`` (a float HF directory) written as an FP8 checkpoint into ``dst``; with
    ``dequantized``, the float checkpoint of its exactly dequantized weights too."""
    from safetensors.torch import load_file, save_file

    if fmt not in ("block", "channel", "tensor"):
        raise ValueError(f"format must be block, channel or tensor, got {fmt!r}")
    scale_suffix = "weight_scale_inv" if fmt == "block" else "weight_scale"
    for out in (dst, dequantized):
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            for f in src.iterdir():
                if (
                    f.is_file()
                    and not f.name.endswith(".safetensors")
                    and f.name != "model.safetensors.index.json"
                ):
                    shutil.copy(f, out / f.name)
    for f in checkpoint_files(src):
        tensors = load_file(str(f))
        fp8, deq = {}, {}
        for name, t in tensors.items():
            if _LINEAR.search(name):
                q, scale, w = quantize(t, fmt, block)
                fp8[name], fp8[name.removesuffix("weight") + scale_suffix] = q, scale
                deq[name] = w.to(t.dtype)
            else:
                fp8[name] = deq[name] = t
        save_file(fp8, str(dst / f.name), metadata={"format": "pt"})
        if dequantized is not None:
            save_file(deq, str(dequantized / f.name), metadata={"format": "pt"})
    if (src / "model.safetensors.index.json").exists():
        _rewrite_index(src, dst, scale_suffix)
        if dequantized is not None:
            shutil.copy(src / "model.safetensors.index.json", dequantized / "model.safetensors.index.json")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, block)
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def _rewrite_index(src: Path, dst: Path, scale_suffix: str) -> None:
    index = json.loads((src / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    for name in [n for n in wm if _LINEAR.search(n)]:
        wm[name.removesuffix("weight") + scale_suffix] = wm[name]
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def main() -> None:
    from splitserve.bench.quant_accuracy import prompt_logits
    from splitserve.engine.engine import Engine
    from splitserve.wire.config import EngineConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="a float HF checkpoint directory")
    ap.add_argument("dst", type=Path, help="where the FP8 checkpoint goes")
    ap.add_argument("--format", choices=["block", "channel", "tensor"], default="block")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--dequantized", type=Path, default=None)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    write_fp8_checkpoint(args.src, args.dst, args.format, args.block, args.dequantized)
    print(f"wrote {args.dst} ({args.format})")
    engines = {
        name: Engine(EngineConfig(model=str(d), dtype=args.dtype, num_kv_blocks=64))
        for name, d in (("fp8", args.dst), ("float", args.src), ("dequantized", args.dequantized))
        if d is not None
    }
    g = torch.Generator().manual_seed(0)
    vocab = engines["fp8"].model_config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (17, 64, 200)]
    logits = {k: torch.cat([prompt_logits(e, p) for p in prompts]) for k, e in engines.items()}
    for ref in [k for k in logits if k != "fp8"]:
        a, b = logits["fp8"], logits[ref]
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item()
        rel = ((a - b).abs().max() / b.abs().max()).item()
        top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        print(
            f"fp8 vs {ref}: mean cosine {cos:.6f}, max |diff| / max |logit| {rel:.2e}, "
            f"argmax equal {top1:.3f}"
        )


if __name__ == "__main__":
    main()
