"""The benchmark models in plain torch (ResNet-50, BERT-base, a small transformer) and their gradient shapes.

The architectures follow the published ones (He et al. 2015, "v1.5" bottlenecks; Devlin et al. 2018), so
``gradient_shapes("resnet50")`` gives the 161 parameter tensors (25,557,032 floats) of torchvision's
ResNet-50 and ``gradient_shapes("bert-base")`` the 199 tensors (109,482,240 floats) of BERT-base
(``BertModel`` of bert-base-uncased, with pooler), without torchvision or transformers. Shapes are
obtained by building the module on torch's "meta" device, so no memory is allocated.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F


# -- ResNet ------------------------------------------------------------------------------------------
class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand by 4, with a projection shortcut if needed."""

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(out_ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(out + identity)


class ResNet(nn.Module):
    """ResNet with bottleneck blocks; ``ResNet()`` is ResNet-50 (blocks 3, 4, 6, 3)."""

    def __init__(self, blocks: tuple[int, ...] = (3, 4, 6, 3), num_classes: int = 1000,
                 base_width: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, base_width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(base_width)
        layers: list[nn.Module] = []
        in_ch = base_width
        for stage, count in enumerate(blocks):
            width = base_width * 2 ** stage
            for i in range(count):
                layers.append(Bottleneck(in_ch, width, stride=2 if (i == 0 and stage > 0) else 1))
                in_ch = width * Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(in_ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(x, 3, stride=2, padding=1)
        x = self.layers(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


# -- BERT-style transformer encoder ----------------------------------------------------------------------
class EncoderLayer(nn.Module):
    """Post-LN encoder layer with BERT's parameter layout: separate q, k, v projections (16 tensors)."""

    def __init__(self, hidden: int, heads: int, intermediate: int) -> None:
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.intermediate = nn.Linear(hidden, intermediate)
        self.output = nn.Linear(intermediate, hidden)
        self.out_norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, h // self.heads).transpose(1, 2)

        ctx = F.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)), split(self.value(x)))
        x = self.attn_norm(x + self.attn_out(ctx.transpose(1, 2).reshape(b, t, h)))
        return self.out_norm(x + self.output(F.gelu(self.intermediate(x))))


class Bert(nn.Module):
    """Embeddings (word, position, token type, LayerNorm), encoder layers and the tanh pooler."""

    def __init__(self, vocab: int = 30522, hidden: int = 768, layers: int = 12, heads: int = 12,
                 intermediate: int = 3072, max_positions: int = 512, type_vocab: int = 2,
                 num_classes: int = 0) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(max_positions, hidden)
        self.token_type = nn.Embedding(type_vocab, hidden)
        self.emb_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.encoder = nn.ModuleList(EncoderLayer(hidden, heads, intermediate) for _ in range(layers))
        self.pooler = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, num_classes) if num_classes else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.word(ids) + self.position(positions)[None] + self.token_type(torch.zeros_like(ids))
        x = self.emb_norm(x)
        for layer in self.encoder:
            x = layer(x)
        pooled = torch.tanh(self.pooler(x[:, 0]))
        return pooled if self.classifier is None else self.classifier(pooled)


def small_transformer(num_classes: int = 10) -> Bert:
    """The transformer of the training benchmark: BERT's layout, 4 layers of width 256 (~7.4M parameters)."""
    return Bert(vocab=16000, hidden=256, layers=4, heads=4, intermediate=1024, max_positions=128,
                num_classes=num_classes)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "resnet50": lambda: ResNet(),
    "bert-base": lambda: Bert(),
    "small-transformer": small_transformer,
}


def gradient_shapes(model: str) -> list[tuple[int, ...]]:
    """Shapes of the model's trainable parameters (= its gradients), in registration order."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
    with torch.device("meta"):
        module = MODELS[model]()
    return [tuple(p.shape) for p in module.parameters() if p.requires_grad]


def scaled_shapes(shapes: list[tuple[int, ...]], scale: float) -> list[tuple[int, ...]]:
    """Shrink every tensor to about ``scale`` times its elements (at least 1), keeping the count; for smoke runs."""
    if scale >= 1.0:
        return list(shapes)
    return [(max(1, int(math.prod(s) * scale)),) for s in shapes]


if __name__ == "__main__":
    for name in MODELS:
        found = gradient_shapes(name)
        print(f"{name}: {len(found)} tensors, {sum(math.prod(s) for s in found):,} elements")
