"""Hand-written transformers models outside the common path, built offline.

- `StackModel`: its blocks are plain `nn.Module`s (not `GradientCheckpointingLayer`); the stack calls
  `self._gradient_checkpointing_func(layer.__call__, hidden)` itself, as Zamba and xLSTM do on transformers 4.57 and
  as remote-code models written for 4.35+ do.
- `LegacyModel`: the pre-4.35 format, `_set_gradient_checkpointing(module, value)`: transformers ignores the
  checkpointing kwargs for it and the model calls `torch.utils.checkpoint.checkpoint` itself (torch's default:
  reentrant), so nothing the plugin decides reaches it.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class TinyConfig(PretrainedConfig):
    model_type = "trl-gc-plugin-tiny"

    def __init__(self, vocab_size: int = 64, hidden_size: int = 16, num_layers: int = 2, **kwargs):
        self.vocab_size, self.hidden_size, self.num_layers = vocab_size, hidden_size, num_layers
        super().__init__(**kwargs)


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + torch.tanh(self.linear(hidden))


class Stack(nn.Module):
    gradient_checkpointing = False

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(config.hidden_size) for _ in range(config.num_layers))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                hidden = self._gradient_checkpointing_func(layer.__call__, hidden)
            else:
                hidden = layer(hidden)
        return hidden


class _Base(PreTrainedModel):
    config_class = TinyConfig
    supports_gradient_checkpointing = True
    main_input_name = "input_ids"

    def __init__(self, config: TinyConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.stack = self._stack(config)
        self.head = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def _stack(self, config: TinyConfig) -> nn.Module:
        return Stack(config)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def _init_weights(self, module: nn.Module) -> None:
        pass

    def forward(self, input_ids=None, labels=None, attention_mask=None, **kwargs) -> CausalLMOutput:
        logits = self.head(self.stack(self.embed(input_ids)))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)


class StackModel(_Base):
    pass


class LegacyStack(Stack):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                hidden = torch.utils.checkpoint.checkpoint(layer, hidden)  # torch's default: reentrant
            else:
                hidden = layer(hidden)
        return hidden


class LegacyModel(_Base):
    def _stack(self, config: TinyConfig) -> nn.Module:
        return LegacyStack(config)

    def _set_gradient_checkpointing(self, module: nn.Module, value: bool = False) -> None:
        if isinstance(module, Stack):
            module.gradient_checkpointing = value


def tiny(cls: type[_Base], seed: int = 0) -> _Base:
    torch.manual_seed(seed)
    return cls(TinyConfig()).train()


def batches(n: int = 8) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 64, (8,), generator=g), "labels": torch.randint(0, 64, (8,), generator=g)}
            for _ in range(n)]
