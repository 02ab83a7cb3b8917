"""A ConvNeXt-style image classifier as a file model
(`fastt run --model src/fastt/examples/convnext.py:build`): depthwise 7x7 convolutions, LayerNorm over
channels through a permute, an inverted bottleneck with GELU, and residual blocks (Liu et al., "A ConvNet for
the 2020s", 2022), small. Issue 17's case: its ops are many and small, and eager's intra-op threads are a
strong baseline on a few cores.
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """Depthwise 7x7 convolution, LayerNorm on the channels (channels last), 4x wider linear, GELU, linear
    back, added to the input."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.down(self.act(self.up(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)


class ChannelNorm(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor, through a permute."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self, dims: tuple[int, ...] = (32, 64, 128), depths: tuple[int, ...] = (2, 2, 2),
                 classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, dims[0], 2, stride=2), ChannelNorm(dims[0])]
        for k, (dim, depth) in enumerate(zip(dims, depths)):
            if k:
                layers += [ChannelNorm(dims[k - 1]), nn.Conv2d(dims[k - 1], dim, 2, stride=2)]
            layers += [Block(dim) for _ in range(depth)]
        self.features = nn.Sequential(*layers)
        self.norm = nn.LayerNorm(dims[-1])
        self.head = nn.Linear(dims[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.features(x).mean((2, 3))))


def build(batch: int = 32, optimizer: str = "adamw") -> tuple:
    """(model, loss_fn, optimizer, example_inputs) for `fastt run`: 32x32 images of 3 channels, 10 classes."""
    torch.manual_seed(0)
    model = ConvNeXt()
    opts = {"sgd": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
            "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
            "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.05)}
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    return model, nn.CrossEntropyLoss(), opts[optimizer](model.parameters()), (x, y)
