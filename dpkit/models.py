"""The models every script trains or measures: the homework CNN, torchvision's resnets, a small GPT.

    from dpkit.models import build_model
    model = build_model("resnet18")          # cnn, resnet18, resnet50 or gpt (GPTConfig sets its size)

All image models take 3x32x32 CIFAR-100 images (the resnets any size) and return 100 logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

NUM_CLASSES = 100
MODELS = ("cnn", "resnet18", "resnet50", "gpt")


class Net(nn.Module):
    """The homework's small CNN: 3x32x32 -> two 3x3 convolutions, max-pool, dropout -> 128 -> 100 logits."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 32, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(32 * 14 * 14, 128)
        self.bn1 = nn.BatchNorm1d(128, affine=False)  # the layer SyncBatchNorm replaces
        self.fc2 = nn.Linear(128, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))                      # (N, 32, 30, 30)
        x = F.relu(self.conv2(x))                      # (N, 32, 28, 28)
        x = self.dropout1(F.max_pool2d(x, 2))          # (N, 32, 14, 14)
        x = F.relu(self.bn1(self.fc1(x.flatten(1))))   # (N, 128)
        return self.fc2(self.dropout2(x))              # (N, 100)


@dataclass(frozen=True)
class GPTConfig:
    """GPT-2 small's shape by default (124M parameters with a 50304-token vocabulary)."""

    vocab: int = 50304
    seq_len: int = 256
    width: int = 768
    depth: int = 12
    heads: int = 12


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then an MLP four times as wide, each added to the
    residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape                                                     # (B, T, C)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)  # each (B, H, T, C/H)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)           # (B, H, T, C/H)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-2-style language model: token and learned position embeddings, ``depth`` blocks, a final
    LayerNorm and an output layer tied to the token embedding (one parameter used twice)."""

    def __init__(self, config: GPTConfig = GPTConfig()):
        super().__init__()
        if config.width % config.heads:
            raise ValueError(f"GPT width {config.width} is not divisible by its {config.heads} heads")
        self.tokens = nn.Embedding(config.vocab, config.width)
        self.positions = nn.Embedding(config.seq_len, config.width)
        self.blocks = nn.ModuleList(Block(config.width, config.heads) for _ in range(config.depth))
        self.ln = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)
        self.head.weight = self.tokens.weight
        self._init_weights(config.depth)

    def _init_weights(self, depth: int) -> None:
        """GPT-2's initialisation: weights N(0, 0.02), biases 0, and the two layers that add to the
        residual stream scaled by 1/sqrt(2 * depth) so its variance does not grow with depth.

        Not PyTorch's defaults: ``nn.Embedding`` draws N(0, 1), and tied to the output layer that gives
        logits of standard deviation ~sqrt(width) (11 at width 128): a first loss many times
        ln(vocab), and a softmax whose smallest probabilities underflow to denormal floats, which
        slow every float32 matmul of the backward on Intel CPUs (microcode assists)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            for residual in (block.proj, block.mlp[2]):
                nn.init.normal_(residual.weight, std=0.02 / (2 * depth) ** 0.5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) token ids -> (B, T, vocab) logits
        x = self.tokens(idx) + self.positions(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build_model(name: str, gpt: GPTConfig = GPTConfig()) -> nn.Module:
    """A fresh, randomly initialised model (seed before calling)."""
    if name == "cnn":
        return Net()
    if name in ("resnet18", "resnet50"):
        import torchvision.models  # imported here: torchvision costs seconds per process

        return getattr(torchvision.models, name)(num_classes=NUM_CLASSES)
    if name == "gpt":
        return GPT(gpt)
    raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}")
