"""Image-classification models of the zoo, written by hand in plain ``torch.nn`` (no torchvision).

Every builder here has the signature ``build(size, batch, dropout) -> (model, loss_fn, example_inputs)`` with
``example_inputs = (images, labels)``; the loss is cross entropy on class labels. ``size="paper"`` is the
architecture as published (parameter counts match torchvision's reference implementations); ``size="test"``
keeps the same topology (ResNet-200: fewer blocks) at a reduced width and image size so one eager training
step takes tens of milliseconds on a 2-core CPU. No model has data-dependent Python control flow, and batch
norms keep no running statistics (see :func:`_bn`), so the forward mutates no buffer.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

Built = tuple[nn.Module, Callable[[torch.Tensor, torch.Tensor], torch.Tensor], tuple[torch.Tensor, ...]]


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of logits ``(..., C)`` against integer labels ``(...)``, averaged over all positions."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _images(batch: int, channels: int, side: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random image batch ``(batch, channels, side, side)`` and labels in ``[0, classes)``."""
    return torch.randn(batch, channels, side, side), torch.randint(0, classes, (batch,))


def _out(n: int, k: int, s: int = 1, p: int = 0) -> int:
    """Spatial output size of a conv/pool with kernel k, stride s, padding p on an input of size n."""
    return (n + 2 * p - k) // s + 1


def _p(dropout: bool, p: float) -> float:
    """The dropout probability p, or 0 when dropout is off."""
    return p if dropout else 0.0


# ----------------------------------------------------------------------------------------------------- LeNet


class LeNet(nn.Module):
    """LeNet-5 (LeCun et al. 1998) with ReLU and max pooling: 2 convs (6, 16 maps of 5x5) and FC
    120-84-classes."""

    def __init__(self, side: int = 32, classes: int = 10, width: int = 1) -> None:
        super().__init__()
        c1, c2 = 6 * width, 16 * width
        self.features = nn.Sequential(
            nn.Conv2d(1, c1, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(c1, c2, 5), nn.ReLU(), nn.MaxPool2d(2))
        s = _out(_out(_out(side, 5), 2, 2), 5) // 2
        self.classifier = nn.Sequential(
            nn.Linear(c2 * s * s, 120 * width), nn.ReLU(), nn.Linear(120 * width, 84 * width), nn.ReLU(),
            nn.Linear(84 * width, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def lenet(size: str, batch: int, dropout: bool) -> Built:
    """LeNet-5. paper: 1x32x32 images (MNIST padded to 32x32 as in the original), 10 classes, 61,706 params,
    batch 64. test: the same net, batch 512 so its ops are big enough to time (no dropout in LeNet)."""
    del size, dropout
    return LeNet(), cross_entropy, _images(batch, 1, 32, 10)


# --------------------------------------------------------------------------------------------------- AlexNet


class AlexNet(nn.Module):
    """AlexNet in its single-tower form (Krizhevsky 2014, "one weird trick"; torchvision's variant)."""

    def __init__(self, side: int = 224, classes: int = 1000, width: float = 1.0, fc: int = 4096,
                 dropout: float = 0.5) -> None:
        super().__init__()
        c = [max(1, round(n * width)) for n in (64, 192, 384, 256, 256)]
        self.features = nn.Sequential(
            nn.Conv2d(3, c[0], 11, 4, 2), nn.ReLU(), nn.MaxPool2d(3, 2),
            nn.Conv2d(c[0], c[1], 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
            nn.Conv2d(c[1], c[2], 3, padding=1), nn.ReLU(),
            nn.Conv2d(c[2], c[3], 3, padding=1), nn.ReLU(),
            nn.Conv2d(c[3], c[4], 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2))
        s = _out(_out(_out(_out(side, 11, 4, 2), 3, 2), 3, 2), 3, 2)
        self.classifier = nn.Sequential(
            nn.Dropout(dropout), nn.Linear(c[4] * s * s, fc), nn.ReLU(),
            nn.Dropout(dropout), nn.Linear(fc, fc), nn.ReLU(), nn.Linear(fc, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def alexnet(size: str, batch: int, dropout: bool) -> Built:
    """AlexNet. paper: 3x224x224, 1000 classes, channels 64-192-384-256-256, FC 4096-4096 (61.1M params),
    batch 128 (the AlexNet paper's batch). test: 3x64x64, the full conv widths, FC 1024, 100 classes, batch
    32."""
    p = _p(dropout, 0.5)
    if size == "paper":
        return AlexNet(dropout=p), cross_entropy, _images(batch, 3, 224, 1000)
    return AlexNet(64, 100, 1.0, 1024, p), cross_entropy, _images(batch, 3, 64, 100)


# ------------------------------------------------------------------------------------------------------ VGG


VGG19_CFG: tuple[int, ...] = (64, 64, 0, 128, 128, 0, 256, 256, 256, 256, 0, 512, 512, 512, 512, 0,
                              512, 512, 512, 512, 0)  # 0 = 2x2 max pool


class VGG(nn.Module):
    """VGG (Simonyan & Zisserman 2015): 3x3 convs with ReLU, 2x2 max pools, three FC layers."""

    def __init__(self, cfg: Sequence[int] = VGG19_CFG, side: int = 224, classes: int = 1000,
                 width: float = 1.0, fc: int = 4096, dropout: float = 0.5) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin, s = 3, side
        for v in cfg:
            if v == 0:
                layers.append(nn.MaxPool2d(2, 2))
                s //= 2
            else:
                cout = max(1, round(v * width))
                layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]
                cin = cout
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Linear(cin * s * s, fc), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(fc, fc), nn.ReLU(), nn.Dropout(dropout), nn.Linear(fc, classes))
        for m in self.modules():  # torchvision's VGG init; PyTorch's default init vanishes over 16 convs
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def vgg19(size: str, batch: int, dropout: bool) -> Built:
    """VGG-19 (configuration E). paper: 3x224x224, 1000 classes, FC 4096 (143.7M params), batch 64.
    test: 3x32x32, channels x1/4 (16..128), FC 512, 100 classes, batch 64."""
    p = _p(dropout, 0.5)
    if size == "paper":
        return VGG(dropout=p), cross_entropy, _images(batch, 3, 224, 1000)
    return VGG(VGG19_CFG, 32, 100, 1 / 4, 512, p), cross_entropy, _images(batch, 3, 32, 100)


# ------------------------------------------------------------------------------------------------- ResNet


def _bn(channels: int, eps: float = 1e-5) -> nn.BatchNorm2d:
    """Standard batch norm (running statistics updated in place during training, as eager does)."""
    return nn.BatchNorm2d(channels, eps=eps)


class Bottleneck(nn.Module):
    """ResNet bottleneck block (1x1, 3x3 with the stride, 1x1 x4; "v1.5" as in torchvision)."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        cout = planes * self.expansion
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = _bn(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = _bn(planes)
        self.conv3 = nn.Conv2d(planes, cout, 1, bias=False)
        self.bn3 = _bn(cout)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), _bn(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.downsample(x))


class ResNet(nn.Module):
    """ResNet with bottleneck blocks (He et al. 2016): 7x7 stem, four stages, global average pool, FC."""

    def __init__(self, blocks: Sequence[int], classes: int = 1000, base: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, base, 7, 2, 3, bias=False), _bn(base), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        stages: list[nn.Module] = []
        cin = base
        for i, n in enumerate(blocks):
            planes = base * 2 ** i
            layers = []
            for j in range(n):
                layers.append(Bottleneck(cin, planes, 2 if (j == 0 and i > 0) else 1))
                cin = planes * Bottleneck.expansion
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, classes)
        for m in self.modules():  # torchvision's ResNet init
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet50(size: str, batch: int, dropout: bool) -> Built:
    """ResNet-50 (blocks 3-4-6-3). paper: 3x224x224, 1000 classes (25.6M params), batch 64.
    test: 3x64x64, base width 16 instead of 64, 100 classes, batch 16. No dropout in ResNets."""
    del dropout
    if size == "paper":
        return ResNet((3, 4, 6, 3)), cross_entropy, _images(batch, 3, 224, 1000)
    return ResNet((3, 4, 6, 3), 100, 16), cross_entropy, _images(batch, 3, 64, 100)


def resnet200(size: str, batch: int, dropout: bool) -> Built:
    """ResNet-200 (blocks 3-24-36-3, He et al. 2016 "Identity mappings", here with post-activation blocks).
    paper: 3x224x224, 1000 classes (64.7M params), batch 32 (it is ~4x the compute of ResNet-50). test: blocks
    3-8-12-3 (deeper than ResNet-50's test size, 3x shallower than paper), base width 16, 3x64x64, 100
    classes, batch 16."""
    del dropout
    if size == "paper":
        return ResNet((3, 24, 36, 3)), cross_entropy, _images(batch, 3, 224, 1000)
    return ResNet((3, 8, 12, 3), 100, 16), cross_entropy, _images(batch, 3, 64, 100)


# --------------------------------------------------------------------------------------------- Inception v3


class Conv(nn.Module):
    """Inception's basic conv: conv without bias, batch norm (eps 1e-3), ReLU."""

    def __init__(self, cin: int, cout: int, kernel: int | tuple[int, int], stride: int = 1,
                 padding: int | tuple[int, int] = 0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride, padding, bias=False)
        self.bn = _bn(cout, eps=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


Width = Callable[[int], int]


class InceptionA(nn.Module):
    """35x35 block: 1x1, 5x5, double 3x3 and pool branches."""

    def __init__(self, cin: int, pool: int, w: Width) -> None:
        super().__init__()
        self.b1 = Conv(cin, w(64), 1)
        self.b5 = nn.Sequential(Conv(cin, w(48), 1), Conv(w(48), w(64), 5, padding=2))
        self.b3 = nn.Sequential(Conv(cin, w(64), 1), Conv(w(64), w(96), 3, padding=1),
                                Conv(w(96), w(96), 3, padding=1))
        self.bp = Conv(cin, w(pool), 1)
        self.out_channels = w(64) + w(64) + w(96) + w(pool)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bp = self.bp(F.avg_pool2d(x, 3, 1, 1))
        return torch.cat([self.b1(x), self.b5(x), self.b3(x), bp], 1)


class InceptionB(nn.Module):
    """35x35 -> 17x17 reduction block."""

    def __init__(self, cin: int, w: Width) -> None:
        super().__init__()
        self.b3 = Conv(cin, w(384), 3, 2)
        self.bd = nn.Sequential(Conv(cin, w(64), 1), Conv(w(64), w(96), 3, padding=1),
                                Conv(w(96), w(96), 3, 2))
        self.out_channels = w(384) + w(96) + cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b3(x), self.bd(x), F.max_pool2d(x, 3, 2)], 1)


class InceptionC(nn.Module):
    """17x17 block with factorized 7x7 convolutions (1x7 then 7x1)."""

    def __init__(self, cin: int, c7: int, w: Width) -> None:
        super().__init__()
        c7 = w(c7)
        self.b1 = Conv(cin, w(192), 1)
        self.b7 = nn.Sequential(Conv(cin, c7, 1), Conv(c7, c7, (1, 7), padding=(0, 3)),
                                Conv(c7, w(192), (7, 1), padding=(3, 0)))
        self.bd = nn.Sequential(Conv(cin, c7, 1), Conv(c7, c7, (7, 1), padding=(3, 0)),
                                Conv(c7, c7, (1, 7), padding=(0, 3)), Conv(c7, c7, (7, 1), padding=(3, 0)),
                                Conv(c7, w(192), (1, 7), padding=(0, 3)))
        self.bp = Conv(cin, w(192), 1)
        self.out_channels = 4 * w(192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bp = self.bp(F.avg_pool2d(x, 3, 1, 1))
        return torch.cat([self.b1(x), self.b7(x), self.bd(x), bp], 1)


class InceptionD(nn.Module):
    """17x17 -> 8x8 reduction block."""

    def __init__(self, cin: int, w: Width) -> None:
        super().__init__()
        self.b3 = nn.Sequential(Conv(cin, w(192), 1), Conv(w(192), w(320), 3, 2))
        self.b7 = nn.Sequential(Conv(cin, w(192), 1), Conv(w(192), w(192), (1, 7), padding=(0, 3)),
                                Conv(w(192), w(192), (7, 1), padding=(3, 0)), Conv(w(192), w(192), 3, 2))
        self.out_channels = w(320) + w(192) + cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b3(x), self.b7(x), F.max_pool2d(x, 3, 2)], 1)


class InceptionE(nn.Module):
    """8x8 block with expanded (1x3 and 3x1 side by side) filter banks."""

    def __init__(self, cin: int, w: Width) -> None:
        super().__init__()
        self.b1 = Conv(cin, w(320), 1)
        self.b3 = Conv(cin, w(384), 1)
        self.b3a = Conv(w(384), w(384), (1, 3), padding=(0, 1))
        self.b3b = Conv(w(384), w(384), (3, 1), padding=(1, 0))
        self.bd = nn.Sequential(Conv(cin, w(448), 1), Conv(w(448), w(384), 3, padding=1))
        self.bda = Conv(w(384), w(384), (1, 3), padding=(0, 1))
        self.bdb = Conv(w(384), w(384), (3, 1), padding=(1, 0))
        self.bp = Conv(cin, w(192), 1)
        self.out_channels = w(320) + 4 * w(384) + w(192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.b3(x)
        bd = self.bd(x)
        bp = self.bp(F.avg_pool2d(x, 3, 1, 1))
        return torch.cat([self.b1(x), self.b3a(b3), self.b3b(b3), self.bda(bd), self.bdb(bd), bp], 1)


class InceptionV3(nn.Module):
    """Inception-v3 (Szegedy et al. 2016) without the auxiliary classifier; layout as in torchvision."""

    def __init__(self, classes: int = 1000, width: float = 1.0, dropout: float = 0.5) -> None:
        super().__init__()

        def w(n: int) -> int:
            return max(1, round(n * width))

        self.stem = nn.Sequential(
            Conv(3, w(32), 3, 2), Conv(w(32), w(32), 3), Conv(w(32), w(64), 3, padding=1), nn.MaxPool2d(3, 2),
            Conv(w(64), w(80), 1), Conv(w(80), w(192), 3), nn.MaxPool2d(3, 2))
        blocks: list[nn.Module] = []
        cin = w(192)
        for make in (lambda c: InceptionA(c, 32, w), lambda c: InceptionA(c, 64, w),
                     lambda c: InceptionA(c, 64, w), lambda c: InceptionB(c, w),
                     lambda c: InceptionC(c, 128, w), lambda c: InceptionC(c, 160, w),
                     lambda c: InceptionC(c, 160, w), lambda c: InceptionC(c, 192, w),
                     lambda c: InceptionD(c, w), lambda c: InceptionE(c, w), lambda c: InceptionE(c, w)):
            block = make(cin)
            blocks.append(block)
            cin = block.out_channels
        self.blocks = nn.Sequential(*blocks)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1)
        return self.fc(self.dropout(torch.flatten(x, 1)))


def inception_v3(size: str, batch: int, dropout: bool) -> Built:
    """Inception-v3 without the auxiliary head. paper: 3x299x299, 1000 classes (23.8M params), batch 64.
    test: 3x75x75 (the smallest input the stride pattern allows), channels x1/4, 100 classes, batch 32."""
    p = _p(dropout, 0.5)
    if size == "paper":
        return InceptionV3(dropout=p), cross_entropy, _images(batch, 3, 299, 1000)
    return InceptionV3(100, 0.25, p), cross_entropy, _images(batch, 3, 75, 100)


# ------------------------------------------------------------------------------------------------------ MLP


class MLP(nn.Module):
    """A stack of Linear + ReLU (+ dropout) layers ending in a classifier."""

    def __init__(self, dims: Sequence[int], dropout: float = 0.1) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(dims)):
            layers.append(nn.Linear(a, b))
            if i < len(dims) - 2:
                layers += [nn.ReLU(), nn.Dropout(dropout)]
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def mlp(size: str, batch: int, dropout: bool) -> Built:
    """A plain MLP (no paper; a compute-dense baseline). paper: 1024 inputs, three hidden layers of 8192,
    1000 classes (150.8M params), dropout 0.1, batch 256. test: 512 inputs, three hidden of 1024,
    10 classes, batch 256."""
    p = _p(dropout, 0.1)
    if size == "paper":
        dims, classes = (1024, 8192, 8192, 8192, 1000), 1000
    else:
        dims, classes = (512, 1024, 1024, 1024, 10), 10
    x = torch.randn(batch, dims[0])
    return MLP(dims, p), cross_entropy, (x, torch.randint(0, classes, (batch,)))
