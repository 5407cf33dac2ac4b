"""The models ``--model`` names. Nothing is downloaded: ``--pretrained PATH`` loads a local file.

- ``vggf``: the VGG-F of the distributed VGG-F work: torchvision's VGG-16 whose last
  classifier layer (4096 -> 1000) becomes Linear(4096, 512), ReLU, Dropout(0.6),
  Linear(512, classes).
- ``wrn``: the WideResNet of the DDP tutorial: conv-bn-relu blocks with residuals,
  channels 16/160/320/640, dropout 0.01, global average pooling.
- ``lenet``: LeNet-5 for RGB input of any size (the demo's model).
- ``resnet18``: torchvision's ResNet-18.
- ``mobilenet``: torchvision's MobileNetV3-Small, its stem conv at stride 1 instead of 2
  so that 32x32 images still leave a 2x2 map before the pooling (at stride 2: 1x1), and
  batch-norm momentum 0.1 (torch's default) instead of torchvision's 0.01.
  ``--model vgg`` is accepted as another name for ``vggf``.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from worker.errors import WorkerError

MODELS = ("vggf", "wrn", "lenet", "resnet18", "mobilenet")
ALIASES = {"vgg": "vggf"}  # the AsyncKFold tables say "VGG"
# Per-model defaults: the input size the source works trained at, and their augmentation.
DEFAULT_IMAGE_SIZE = {"vggf": 224, "resnet18": 224, "wrn": 32, "lenet": 32, "mobilenet": 32}
AUGMENTATION = {"vggf": "resized_crop_flip", "resnet18": "resized_crop_flip",
                "wrn": "crop_flip", "lenet": "crop_flip", "mobilenet": "crop_flip"}


class CBR(nn.Sequential):
    """3x3 conv (same padding, no bias), batch norm, ReLU."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class WideBlock(nn.Module):
    """Two CBRs with dropout between, plus the input (1x1-conv projected when widths differ)."""

    def __init__(self, cin: int, cout: int, dropout: float = 0.01) -> None:
        super().__init__()
        self.scale = nn.Conv2d(cin, cout, 1) if cin != cout else None
        self.layer1 = CBR(cin, cout)
        self.dropout = nn.Dropout(dropout)
        self.layer2 = CBR(cout, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer2(self.dropout(self.layer1(x)))
        return out + (self.scale(x) if self.scale is not None else x)


class WideResNet(nn.Module):
    def __init__(self, num_classes: int, widths: tuple[int, ...] = (16, 160, 320, 640)) -> None:
        super().__init__()
        w0, w1, w2, w3 = widths
        self.features = nn.Sequential(
            CBR(3, w0), WideBlock(w0, w1), WideBlock(w1, w1), nn.MaxPool2d(2),
            WideBlock(w1, w2), WideBlock(w2, w2), nn.MaxPool2d(2),
            WideBlock(w2, w3), WideBlock(w3, w3),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())  # global average pooling: any input size
        self.fc = nn.Linear(w3, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


class LeNet(nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(5), nn.Flatten())  # 32x32 input: exactly LeNet-5's 16x5x5
        self.classifier = nn.Sequential(
            nn.Linear(16 * 5 * 5, 120), nn.ReLU(inplace=True),
            nn.Linear(120, 84), nn.ReLU(inplace=True), nn.Linear(84, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def vggf(num_classes: int) -> nn.Module:
    from torchvision.models import vgg16  # torchvision costs ~1 s of import: only when needed

    model = vgg16(weights=None)
    model.classifier[6] = nn.Sequential(
        nn.Linear(4096, 512), nn.ReLU(inplace=True), nn.Dropout(0.6), nn.Linear(512, num_classes))
    return model


def resnet18(num_classes: int) -> nn.Module:
    from torchvision.models import resnet18 as tv_resnet18

    return tv_resnet18(weights=None, num_classes=num_classes)


def mobilenet(num_classes: int) -> nn.Module:
    from torchvision.models import mobilenet_v3_small

    model = mobilenet_v3_small(weights=None, num_classes=num_classes)
    model.features[0][0].stride = (1, 1)  # small images: keep resolution in the stem
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            # torchvision's 0.01 suits ImageNet's 20,000 steps an epoch; on a small set the
            # running statistics would still be near their initial values at evaluation.
            m.momentum = 0.1
    return model


def build_model(name: str, num_classes: int) -> nn.Module:
    name = ALIASES.get(name, name)
    builders = {"vggf": vggf, "wrn": WideResNet, "lenet": LeNet, "resnet18": resnet18,
                "mobilenet": mobilenet}
    if name not in builders:
        raise WorkerError(f"unknown model {name!r}", hint=f"--model one of {', '.join(MODELS)}")
    return builders[name](num_classes)


def logits_param_names(model: nn.Module) -> set[str]:
    """Names (as in ``model.named_parameters()``) of the last layer that owns parameters."""
    owners = [(n, m) for n, m in model.named_modules() if list(m.parameters(recurse=False))]
    prefix, last = owners[-1]
    return {f"{prefix}.{n}" if prefix else n for n, _ in last.named_parameters(recurse=False)}


def load_pretrained(model: nn.Module, path: Path) -> str:
    """Copy every tensor of ``path`` whose name and shape match; the rest stays initialised.

    That takes torchvision's ImageNet VGG-16 file as it is: its 1000-way layer is skipped.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError) as e:
        raise WorkerError(f"cannot load --pretrained {path}: {e}",
                          hint="give a state_dict saved with torch.save") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]  # one of our own checkpoints
    own = model.state_dict()
    match = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    if not match:
        raise WorkerError(f"--pretrained {path}: no tensor matches the model's names and shapes",
                          hint="use weights of the same architecture (e.g. torchvision's vgg16)")
    model.load_state_dict(match, strict=False)
    return f"loaded {len(match)}/{len(own)} tensors from {path}"
