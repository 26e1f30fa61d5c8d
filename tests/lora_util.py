"""PEFT LoRA adapters for tests, and their reference: transformers + PEFT with the
adapter merged (``merged_greedy``)."""

from __future__ import annotations

import torch

from tests.conftest import hf_greedy


def make_adapter(checkpoint, directory, rank: int, alpha: float, targets: list[str], rslora: bool, seed: int):
    """A PEFT LoRA adapter of the checkpoint's model with random A and B (B non-zero:
    it changes the tokens), saved to ``directory``."""
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False
    )
    model = peft.get_peft_model(base, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(str(directory))


def merged_greedy(checkpoint, adapter_dir, prompts, max_new: int) -> list[list[int]]:
    """transformers' greedy tokens of each prompt, the adapter at ``adapter_dir`` merged
    into the model (None: the base model)."""
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    return [hf_greedy(model, p, max_new) for p in prompts]
