"""A tiny EAGLE head (vLLM's speculative method "eagle") for a Llama target built by kvlink.demo.tiny_model.

vLLM's EagleLlamaForCausalLM (vllm/model_executor/models/llama_eagle.py) reads a Llama config with one hidden
layer (vLLM wraps it in an EAGLEConfig and names the architecture EagleLlamaForCausalLM) and the weights
``fc.weight`` ([hidden, 2 * hidden]: the token's embedding, then the target's hidden state), ``layers.0.*``
(a Llama decoder layer whose input_layernorm vLLM replaces by the identity, so the checkpoint has none),
optionally ``embed_tokens.weight`` (kept when it differs from the target's, else shared) and no lm_head
(vLLM's EagleLlamaForCausalLM has none to load into: the target's is shared) and no final norm: its
logits are ``lm_head(h + residual)``. Its one attention layer is the model's layer ``num_target_layers``
(``model.layers.2.self_attn.attn`` behind a 2-layer target), with a KV cache of its own in the target's
KV cache group.

Random weights would propose tokens the target never picks (no acceptance, before or after a transfer), so
the head here is the target's layer 0 refolded into EAGLE's shape: the drafter then computes the target
without its last layer and predicts the target's next token most of the time (about 60-90 % of positions
with the tiny preset), and, through its attention, from its own KV cache: noise there costs acceptance.
The target's final RMSNorm weight ``g`` (random in the tiny preset) is folded in by running the drafter's
residual stream scaled by ``g`` (embedding ``e * g``, ``o_proj`` and ``down_proj`` rows times ``g``, the
layer's input projections divided by it), so that the shared lm_head sees ``g * h`` as the target's sees
``g * h / rms(h)`` (the same argmax). The missing input RMSNorm is a constant 1 / rms of an embedding row.
The hidden-state half of ``fc`` is small seeded noise: the path is fed, and does not decide.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SEED = 4321
HIDDEN_NOISE = 1e-5  # std of fc's hidden-state half (the embedding half carries rows of std ~0.0025)


def build_eagle_head(target: str | Path, out: str | Path) -> str:
    """Write an EAGLE head for the Llama at ``target`` into ``out`` (idempotent, deterministic)."""
    import torch
    from safetensors.torch import load_file, save_file

    target, out = Path(target), Path(out)
    done = out / "kvlink-eagle.json"
    if done.exists():
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((target / "config.json").read_text())
    w = {k: v.float() for k, v in load_file(str(target / "model.safetensors")).items()}
    hidden = cfg["hidden_size"]
    g = w["model.norm.weight"]  # the target's final norm weight, folded into the residual stream
    e = w["model.embed_tokens.weight"]
    r = e.pow(2).mean(-1).sqrt().mean()  # a typical embedding row's rms: the input norm's missing 1/rms
    n0 = w["model.layers.0.input_layernorm.weight"]
    n1 = w["model.layers.0.post_attention_layernorm.weight"]
    p = "model.layers.0."
    inv = n0 / (g * r)  # input columns: undo g, apply the input norm's weight and 1/rms
    head = {
        "embed_tokens.weight": e * g,
        "fc.weight": torch.cat([torch.eye(hidden), torch.randn(hidden, hidden,
                                                               generator=torch.Generator().manual_seed(SEED))
                                * HIDDEN_NOISE], dim=1),
        "layers.0.self_attn.q_proj.weight": w[p + "self_attn.q_proj.weight"] * inv,
        "layers.0.self_attn.k_proj.weight": w[p + "self_attn.k_proj.weight"] * inv,
        "layers.0.self_attn.v_proj.weight": w[p + "self_attn.v_proj.weight"] * inv,
        "layers.0.self_attn.o_proj.weight": w[p + "self_attn.o_proj.weight"] * g[:, None],
        # RMSNorm of g * h is rms(g)-ish times h's: undo g per column and rescale
        "layers.0.post_attention_layernorm.weight": n1 / g * g.pow(2).mean().sqrt(),
        "layers.0.mlp.gate_proj.weight": w[p + "mlp.gate_proj.weight"],
        "layers.0.mlp.up_proj.weight": w[p + "mlp.up_proj.weight"],
        "layers.0.mlp.down_proj.weight": w[p + "mlp.down_proj.weight"] * g[:, None],
    }
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in head.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = dict(cfg, num_hidden_layers=1, architectures=["LlamaForCausalLM"])
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in target.iterdir():  # the tokenizer (vLLM loads the draft's config through the target's tokenizer)
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    done.write_text(json.dumps({"target": str(target), "seed": SEED}) + "\n")
    return str(out)
