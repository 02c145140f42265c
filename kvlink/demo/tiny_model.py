"""Build a small local model (random weights, local tokenizer) for tests, demo and benchmark.

Nothing is fetched from a hub: the weights are random (seeded), saved as bf16 safetensors, and the
tokenizer is a byte-level BPE trained here on a generated corpus and saved as PreTrainedTokenizerFast.
The same preset and seed always produce the same files.

    python -m kvlink.demo.tiny_model --preset tiny --out .models/tiny
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_ROOT = Path(__file__).resolve().parents[2] / ".models"
SEED = 1234
_DONE_MARKER = "kvlink-model.json"

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


@dataclass(frozen=True)
class Preset:
    name: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int = 1024
    max_positions: int = 4096
    sliding_window: int | None = None  # tokens; set: a Mistral whose every layer attends to this window
    mla: bool = False  # a DeepSeek-V2 (multi-head latent attention): one 512 + 64 latent per token and layer
    hybrid: bool = False  # with sliding_window: layers alternate sliding-window and full attention (Gemma 3 style)
    mamba: bool = False  # a NemotronH: Mamba2 and attention layers alternate (a MambaSpec KV cache group)
    pattern: str | None = None  # with mamba: NemotronH's layer kinds ("M" Mamba2, "*" attention), else "M*M*..."
    moe: bool = False  # with mla: layer 0 dense, the rest Mixture-of-Experts (grouped routing, as vLLM CPU needs)
    init_std: float = 0.05  # weights ~ N(0, std): larger than HF's default, so greedy outputs depend on the KV

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V (MLA: the latent), every layer, bf16."""
        return self.num_layers * ((512 + 64) if self.mla else 2 * self.kv_heads * self.head_dim) * 2


PRESETS = {
    # Fast tests: 1 KiB of KV per token, 3 MB of weights.
    "tiny": Preset("tiny", num_layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512),
    # Benchmark: 32 KiB of KV per token but small weights (head_dim is decoupled from hidden).
    "kvheavy": Preset("kvheavy", num_layers=8, hidden=256, heads=8, kv_heads=8, head_dim=128, intermediate=512),
    # Sliding window on every layer: vLLM builds one SlidingWindowSpec KV cache group, and the block
    # tables of long prompts hold null blocks before the window (tests of block pairing by position).
    "swa": Preset("swa", num_layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512,
                  sliding_window=64),
    # Hybrid: sliding-window and full-attention layers alternate, so vLLM's hybrid KV cache manager makes two
    # KV cache groups (a SlidingWindowSpec and a FullAttentionSpec) when the connector supports it.
    "hybrid": Preset("hybrid", num_layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512,
                     sliding_window=64, hybrid=True),
    # Mamba: NemotronH layers alternate Mamba2 and attention ("M*M*"): vLLM builds a MambaSpec group (one state
    # block per request) and a FullAttentionSpec group. vLLM CPU's Mamba2 prefill kernel fails with prefix
    # caching on (mamba_cache_mode "align"): run it with enable_prefix_caching=False.
    "mamba": Preset("mamba", num_layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512,
                    mamba=True, init_std=0.2),
    # Mamba under pipeline parallelism: "M***" puts a Mamba2 and an attention layer on stage 0 of two and
    # attention only on stage 1, so the stages hold different kinds of KV cache layer.
    "mamba_pp": Preset("mamba_pp", num_layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512,
                       mamba=True, pattern="M***", init_std=0.2),
    # MLA: vLLM builds an MLAAttentionSpec group, one latent tensor per layer and no K/V split. vLLM CPU's
    # MLA backend needs the 512 + 64 latent width (smaller ones fail); every layer dense (no MoE router).
    # At std 0.05 its greedy outputs change with how vLLM chunks a prompt (its MLA prefill and decode paths
    # round differently in bf16), with no connector involved; at 0.02 chunking leaves them alone.
    "mla": Preset("mla", num_layers=2, hidden=256, heads=4, kv_heads=4, head_dim=64, intermediate=512, mla=True,
                  init_std=0.02),
    # MoE: the MLA DeepSeek-V2 with its layers after the first Mixture-of-Experts (4 routed experts in 2 groups,
    # 2 a token from 1 group, one shared expert). vLLM CPU's MoE router asserts unless n_group and topk_group are
    # set. It serves on one engine; with --data-parallel-size 2 vLLM CPU 0.32 fails at the first forward (its MoE
    # dispatch calls all_gatherv, which CpuCommunicator does not implement), with or without a connector, unless
    # tests/vllm/moe_dp_shim (test-only) supplies the two collectives.
    "moe": Preset("moe", num_layers=2, hidden=256, heads=4, kv_heads=4, head_dim=64, intermediate=512, mla=True,
                  moe=True, init_std=0.02),
}


def _corpus(n_lines: int = 4000) -> list[str]:
    """A deterministic pseudo-English corpus for training the tokenizer."""
    rng = random.Random(SEED)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "te", "vo", "zi", "pa", "do", "gu", "the", "and",
                 "ing", "er", "on", "at", "re", "in", "st", "ch", "qu", "ph"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(600)]
    words += ("the a of to in is it you that he was for on are with as I his they be at one have this "
              "from or had by word but what some we can out other were all there when up use your how "
              "said an each she which do their time if will way about many then them write would like "
              "so these her long make thing see him two has look more day could go come did number "
              "sound no most people my over know water than call first who may down side been now find "
              "kv cache prefill decode block transfer token model engine").split()
    lines = []
    for _ in range(n_lines):
        n = rng.randint(4, 16)
        line = " ".join(rng.choice(words) for _ in range(n))
        lines.append(line.capitalize() + rng.choice([".", "!", "?", ",", ";"]) + " " + str(rng.randint(0, 999)))
    return lines


def _build_tokenizer(preset: Preset, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=preset.vocab, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def _build_weights(preset: Preset, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(SEED)
    config_cls, model_cls, extra = LlamaConfig, LlamaForCausalLM, {}
    if preset.mla:
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        config_cls, model_cls = DeepseekV2Config, DeepseekV2ForCausalLM
        extra = {"kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64,
                 "v_head_dim": 64, "first_k_dense_replace": preset.num_layers, "n_routed_experts": 4,
                 "n_shared_experts": 1, "moe_intermediate_size": 64, "num_experts_per_tok": 2}
        if preset.moe:
            extra.update(first_k_dense_replace=1, n_group=2, topk_group=1, topk_method="group_limited_greedy")
    if preset.mamba:
        from transformers import NemotronHConfig, NemotronHForCausalLM

        config_cls, model_cls = NemotronHConfig, NemotronHForCausalLM
        extra = {"hybrid_override_pattern": preset.pattern or "M*" * (preset.num_layers // 2), "mamba_num_heads": 8,
                 "mamba_head_dim": 32, "n_groups": 1, "ssm_state_size": 16, "conv_kernel": 4, "expand": 1,
                 "chunk_size": 32}
    if preset.sliding_window is not None:
        config_cls, model_cls, extra = MistralConfig, MistralForCausalLM, {"sliding_window": preset.sliding_window}
        if preset.hybrid:
            extra["layer_types"] = [("sliding_attention", "full_attention")[i % 2] for i in range(preset.num_layers)]
    cfg = config_cls(
        vocab_size=preset.vocab, hidden_size=preset.hidden, intermediate_size=preset.intermediate,
        num_hidden_layers=preset.num_layers, num_attention_heads=preset.heads,
        num_key_value_heads=preset.kv_heads, head_dim=preset.head_dim,
        max_position_embeddings=preset.max_positions, bos_token_id=1, eos_token_id=2, pad_token_id=3,
        tie_word_embeddings=False, torch_dtype="bfloat16", **extra)
    model = model_cls(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, preset.init_std)
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)


def ensure_model(preset: str = "tiny", out: str | os.PathLike | None = None) -> Path:
    """Build the preset's model into ``out`` (default .models/<preset>) unless already there."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid: {sorted(PRESETS)}")
    p = PRESETS[preset]
    path = Path(out) if out is not None else DEFAULT_ROOT / preset
    marker = path / _DONE_MARKER
    if marker.exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    logger.info("building %s model into %s", preset, path)
    _build_tokenizer(p, path)
    _build_weights(p, path)
    marker.write_text(json.dumps({"preset": p.name, "seed": SEED, "init_std": p.init_std,
                                  "kv_bytes_per_token": p.kv_bytes_per_token,
                                  "sliding_window": p.sliding_window, "hybrid": p.hybrid,
                                  "mamba": p.mamba, "pattern": p.pattern, "moe": p.moe}) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--out", default=None, help="directory (default .models/<preset>)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = ensure_model(args.preset, args.out)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
