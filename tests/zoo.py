"""An architecture zoo: tiny models of many transformers families, built offline from configs, with a batch each.

Every entry builds a model small enough to train 2 steps on CPU in well under a second, and a batch of the shape
its forward expects (token ids, token types, encoder-decoder labels, images, audio features). The families are
chosen for what reaches the first checkpointed block: rotary positions only (Llama, Qwen2, Mistral...), learned
position embeddings (GPT-2, OPT), embedding norms (Bloom, BART), token-type embeddings (BERT), encoder-decoder
stacks (T5, BART, Whisper), vision towers (LLaVA with `vision_feature_layer=-2`, Qwen2-VL), mixtures of experts
(Mixtral, Qwen3-MoE, DeepSeek-V3), and a state-space model (Mamba).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import transformers
from packaging.version import Version

TF = Version(transformers.__version__)
VOCAB = 64
HIDDEN = 32
SEQ = 12
BATCH = 2


@dataclasses.dataclass(frozen=True)
class Arch:
    """One zoo entry: `build()` returns a model in float32 and train mode; `batch(seed)` a dict for `model(**batch)`
    with labels; `lora` the LoRA target module names; `task` the PEFT task type."""

    name: str
    build: Callable[[], Any]
    batch: Callable[[int], dict[str, torch.Tensor]]
    lora: tuple[str, ...]
    task: str | None = "CAUSAL_LM"
    kind: str = "decoder"  # decoder | encoder | encoder-decoder | vlm | ssm
    writes_state: bool = False  # its checkpointed forward writes module state (a counter): replayed by the recompute


def _ids(seed: int, vocab: int = VOCAB, shape: tuple[int, int] = (BATCH, SEQ), low: int = 3) -> torch.Tensor:
    return torch.randint(low, vocab, shape, generator=torch.Generator().manual_seed(seed))


def lm_batch(seed: int) -> dict[str, torch.Tensor]:
    ids = _ids(seed)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def cls_batch(seed: int) -> dict[str, torch.Tensor]:
    ids = _ids(seed)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 1])}


def bert_batch(seed: int) -> dict[str, torch.Tensor]:
    out = cls_batch(seed)
    out["token_type_ids"] = torch.cat([torch.zeros(BATCH, SEQ // 2), torch.ones(BATCH, SEQ - SEQ // 2)], 1).long()
    return out


def seq2seq_batch(seed: int) -> dict[str, torch.Tensor]:
    ids = _ids(seed)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": _ids(seed + 1, shape=(BATCH, 6))}


def _seeded(build: Callable[[], Any]) -> Callable[[], Any]:
    def wrapped() -> Any:
        torch.manual_seed(0)
        return build().float().train()

    return wrapped


def count_in_blocks(model: Any, how: str = "buffer", reads: bool = False) -> list[Any]:
    """Every checkpointable block counts the tokens it sees in its training forward, in a buffer (in place) or in a
    plain int attribute, as MoE tokens-per-expert statistics do: the block's class gets a subclass whose forward
    counts (transformers 5 checkpoints `forward`, 4.x `__call__`: both recompute it). With `reads`, the block's
    output depends on the count (its input is scaled by it before the block runs), so the recompute computes another
    function than the forward did. Returns the blocks."""
    from trl_gc_plugin.model import ckpt

    blocks = ckpt.blocks(model)
    assert blocks, "no checkpointable block found"
    counting: dict[type, type] = {}
    for block in blocks:
        cls = type(block)
        if cls not in counting:

            def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
                hidden = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
                if self.training:
                    self.tokens_seen += hidden.shape[0] * hidden.shape[1]
                    if self.reads_count:
                        scaled = hidden * (1.0 + 0.01 * float(self.tokens_seen))
                        args, kwargs = ((scaled, *args[1:]), kwargs) if args else (args, {
                            k: scaled if v is hidden else v for k, v in kwargs.items()})
                return super(counting[type(self)], self).forward(*args, **kwargs)

            counting[cls] = type(f"Counting{cls.__name__}", (cls,), {"forward": forward})
            counting[counting[cls]] = counting[cls]
        if how == "buffer":
            block.register_buffer("tokens_seen", torch.zeros((), dtype=torch.long))
        else:
            block.tokens_seen = 0
        block.reads_count = reads
        block.__class__ = counting[cls]
    return blocks


def _counting(build: Callable[[], Any]) -> Callable[[], Any]:
    def wrapped() -> Any:
        model = build()
        count_in_blocks(model)
        return model

    return wrapped


def _causal(config_cls: str, model_cls: str = "AutoModelForCausalLM", **kw: Any) -> Callable[[], Any]:
    def build() -> Any:
        config = getattr(transformers, config_cls)(vocab_size=VOCAB, **kw)
        config._attn_implementation = "eager"
        return getattr(transformers, model_cls).from_config(config, attn_implementation="eager")

    return _seeded(build)


LLAMA_LIKE = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, tie_word_embeddings=False)


def _llava() -> Any:
    vision = transformers.CLIPVisionConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, image_size=8, patch_size=4, projection_dim=HIDDEN)
    text = transformers.LlamaConfig(vocab_size=VOCAB + 1, **LLAMA_LIKE)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=VOCAB,
                                      vision_feature_layer=-2, vision_feature_select_strategy="default",
                                      projector_hidden_act="gelu")
    return transformers.LlavaForConditionalGeneration(config)


def llava_batch(seed: int) -> dict[str, torch.Tensor]:
    ids = _ids(seed)
    ids[:, 1:5] = VOCAB  # 4 image tokens: (8 / 4) ** 2 patches, CLS dropped by the "default" strategy
    labels = ids.clone()
    labels[:, :5] = -100
    pixels = torch.randn(BATCH, 3, 8, 8, generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels, "labels": labels}


QWEN2VL_IMAGE = VOCAB + 1


def _qwen2_vl() -> Any:
    vision = dict(depth=2, embed_dim=HIDDEN, hidden_size=HIDDEN, num_heads=4, mlp_ratio=2, patch_size=2,
                  temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
    text = dict(vocab_size=VOCAB + 4, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, tie_word_embeddings=False)
    common = dict(image_token_id=QWEN2VL_IMAGE, video_token_id=VOCAB + 2, vision_start_token_id=VOCAB + 3,
                  vision_config=vision)
    if Version("5.0.0") <= TF:
        config = transformers.Qwen2VLConfig(text_config=text, **common)
    else:
        config = transformers.Qwen2VLConfig(**text, **common)
    config._attn_implementation = "eager"
    return transformers.Qwen2VLForConditionalGeneration(config)


def qwen2_vl_batch(seed: int) -> dict[str, torch.Tensor]:
    # one 4x4-patch image per sample (grid 1x4x4), merged 2x2 -> 4 image tokens
    ids = _ids(seed)
    ids[:, 1] = VOCAB + 3
    ids[:, 2:6] = QWEN2VL_IMAGE
    labels = ids.clone()
    labels[:, :6] = -100
    patches = torch.randn(BATCH * 16, 3 * 2 * 2 * 2, generator=torch.Generator().manual_seed(seed))
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": patches,
           "image_grid_thw": torch.tensor([[1, 4, 4]] * BATCH), "labels": labels}
    if Version("5.0.0") <= TF:  # 5.x takes the token types from the processor: 1 marks image tokens
        out["mm_token_type_ids"] = (ids == QWEN2VL_IMAGE).int()
    return out


def _whisper() -> Any:
    config = transformers.WhisperConfig(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2, decoder_layers=2,
                                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                        decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=8,
                                        max_target_positions=32, pad_token_id=0, decoder_start_token_id=1,
                                        suppress_tokens=None, begin_suppress_tokens=None)
    return transformers.WhisperForConditionalGeneration(config)


def whisper_batch(seed: int) -> dict[str, torch.Tensor]:
    feats = torch.randn(BATCH, 8, 16, generator=torch.Generator().manual_seed(seed))  # 16 frames -> 8 positions
    return {"input_features": feats, "labels": _ids(seed + 1, shape=(BATCH, 6))}


ZOO: tuple[Arch, ...] = (
    Arch("llama", _causal("LlamaConfig", **LLAMA_LIKE), lm_batch, ("q_proj", "v_proj")),
    Arch("qwen2", _causal("Qwen2Config", **LLAMA_LIKE), lm_batch, ("q_proj", "v_proj")),
    Arch("mistral", _causal("MistralConfig", **LLAMA_LIKE), lm_batch, ("q_proj", "v_proj")),
    Arch("gemma2", _causal("Gemma2Config", head_dim=8, **LLAMA_LIKE), lm_batch, ("q_proj", "v_proj")),
    Arch("phi3", _causal("Phi3Config", **LLAMA_LIKE), lm_batch, ("qkv_proj",)),
    Arch("mixtral", _causal("MixtralConfig", num_local_experts=4, num_experts_per_tok=2, **LLAMA_LIKE), lm_batch,
         ("q_proj", "v_proj"), kind="moe"),
    Arch("qwen3_moe", _causal("Qwen3MoeConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              head_dim=8, **LLAMA_LIKE), lm_batch, ("q_proj", "v_proj"), kind="moe"),
    # a Llama whose decoder blocks count the tokens they see (a buffer updated in the forward, as MoE load statistics
    # are): the recompute counts every batch again; the plugin says so and refuses nothing
    Arch("llama_counter", _counting(_causal("LlamaConfig", **LLAMA_LIKE)), lm_batch, ("q_proj", "v_proj"),
         writes_state=True),
    Arch("gpt2", _causal("GPT2Config", n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=64, tie_word_embeddings=False),
         lm_batch, ("c_attn",)),
    Arch("opt", _causal("OPTConfig", hidden_size=HIDDEN, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                        max_position_embeddings=64, word_embed_proj_dim=HIDDEN, pad_token_id=1,
                        tie_word_embeddings=False), lm_batch, ("q_proj", "v_proj")),
    Arch("bloom", _causal("BloomConfig", hidden_size=HIDDEN, n_layer=2, n_head=4, tie_word_embeddings=False),
         lm_batch, ("query_key_value",)),
    Arch("gpt_neox", _causal("GPTNeoXConfig", hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=64, tie_word_embeddings=False),
         lm_batch, ("query_key_value",)),
    Arch("falcon", _causal("FalconConfig", hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                           new_decoder_architecture=False, tie_word_embeddings=False), lm_batch,
         ("query_key_value",)),
    Arch("llama_seq_cls", _causal("LlamaConfig", "AutoModelForSequenceClassification", num_labels=2, **LLAMA_LIKE),
         cls_batch, ("q_proj", "v_proj"), task="SEQ_CLS", kind="encoder"),
    Arch("bert_seq_cls", _causal("BertConfig", "AutoModelForSequenceClassification", hidden_size=HIDDEN,
                                 intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 max_position_embeddings=64, num_labels=2), bert_batch, ("query", "value"),
         task="SEQ_CLS", kind="encoder"),
    Arch("t5", _causal("T5Config", "AutoModelForSeq2SeqLM", d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=2,
                       num_decoder_layers=2, num_heads=4, decoder_start_token_id=0, pad_token_id=0),
         seq2seq_batch, ("q", "v"), task="SEQ_2_SEQ_LM", kind="encoder-decoder"),
    Arch("bart", _causal("BartConfig", "AutoModelForSeq2SeqLM", d_model=HIDDEN, encoder_layers=2, decoder_layers=2,
                         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                         max_position_embeddings=64, pad_token_id=1, decoder_start_token_id=2),
         seq2seq_batch, ("q_proj", "v_proj"), task="SEQ_2_SEQ_LM", kind="encoder-decoder"),
    # task None: a plain PeftModel passes `input_features` through (PEFT's seq2seq wrapper insists on input_ids)
    Arch("whisper", _seeded(_whisper), whisper_batch, ("q_proj", "v_proj"), task=None, kind="encoder-decoder"),
    Arch("llava", _seeded(_llava), llava_batch, ("q_proj", "v_proj"), kind="vlm"),
    Arch("qwen2_vl", _seeded(_qwen2_vl), qwen2_vl_batch, ("q_proj", "v_proj", "qkv"), kind="vlm"),
    Arch("mamba", _causal("MambaConfig", hidden_size=HIDDEN, state_size=4, num_hidden_layers=2, expand=2,
                          conv_kernel=2, use_mambapy=False), lm_batch, ("in_proj", "x_proj"), kind="ssm"),
)

BY_NAME = {arch.name: arch for arch in ZOO}
