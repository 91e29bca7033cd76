"""A ResNet-style CNN for 32x32 images (CIFAR-size): stem, residual blocks, head."""
from __future__ import annotations

import torch
from torch import nn

from .chain import ChainLayer, ChainModel


class ConvBN(ChainLayer):
    kind = "dense"

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x):
        return (torch.relu(self.bn(self.conv(x))),)


class ResBlock(ChainLayer):
    kind = "dense"

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.c1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(c_out)
        self.c2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(c_out)
        self.skip = (nn.Identity() if stride == 1 and c_in == c_out else
                     nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)))

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        return (torch.relu(self.b2(self.c2(y)) + self.skip(x)),)


class Head(ChainLayer):
    kind = "memory"

    def __init__(self, c: int, n_classes: int):
        super().__init__()
        self.fc = nn.Linear(c, n_classes)

    def forward(self, x):
        return (self.fc(x.mean(dim=(2, 3))),)


class CNNModel(ChainModel):
    def __init__(self, widths=(32, 64, 128), blocks: int = 2, n_classes: int = 10, image: int = 32):
        self.image, self.n_classes = image, n_classes
        layers: list[tuple[str, ChainLayer]] = [("stem", ConvBN(3, widths[0]))]
        c = widths[0]
        for s, w in enumerate(widths):
            for b in range(blocks):
                layers.append((f"block{s}.{b}", ResBlock(c, w, 2 if (b == 0 and s > 0) else 1)))
                c = w
        layers.append(("head", Head(c, n_classes)))
        super().__init__(layers)

    def example_inputs(self, batch: int, generator: torch.Generator | None = None):
        return (torch.randn(batch, 3, self.image, self.image, generator=generator),)

    def loss(self, output, target):
        return nn.functional.cross_entropy(output, target)
