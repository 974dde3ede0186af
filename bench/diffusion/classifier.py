"""An independent judge of generated digits: a small CNN trained on the digits' training split.

    digit_classifier()   trained once per process (a few seconds, seeded), then cached
    .predict(images)     class ids of images [n, 1, 8, 8] in [-1, 1]
    .features(images)    its penultimate layer [n, 64]: the space the Fréchet distance is taken in
    .heldout_accuracy    its accuracy on the 300 held-out real digits neither model trained on

It trains on the same split as the generator, so it has never seen the held-out digits either.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from torch import nn

from pagemesh.workers.diffusion.training.digits_data import NUM_CLASSES, heldout_split, train_split

FEATURES = 64


class DigitCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 64 x 4 x 4
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, FEATURES),
            nn.ReLU(),
        )
        self.head = nn.Linear(FEATURES, NUM_CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(images))


def _shift(images: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    # Random one-pixel translations (padded with the background value): generated digits are
    # not centred exactly like the scans, and the judge should not punish that.
    padded = nn.functional.pad(images, (1, 1, 1, 1), value=-1.0)
    dx, dy = torch.randint(0, 3, (2,), generator=gen).tolist()
    return padded[:, :, dy : dy + 8, dx : dx + 8]


class DigitClassifier:
    """A trained DigitCNN in eval mode, with its held-out accuracy."""

    def __init__(self, model: DigitCNN):
        self.model = model.eval()
        heldout = heldout_split()
        self.heldout_accuracy = float((self.predict(heldout.images) == heldout.labels).float().mean())

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images.float()).argmax(dim=1)

    @torch.no_grad()
    def features(self, images: torch.Tensor) -> torch.Tensor:
        return self.model.body(images.float())


def train_classifier(*, epochs: int = 10, seed: int = 0) -> DigitClassifier:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    data = train_split()
    model = DigitCNN()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(data.labels), generator=gen)
        for batch in order.split(64):
            loss = nn.functional.cross_entropy(model(_shift(data.images[batch], gen)), data.labels[batch])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return DigitClassifier(model)


@lru_cache(maxsize=1)
def digit_classifier() -> DigitClassifier:
    return train_classifier()


def frechet_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fréchet distance between Gaussians fitted to feature sets a [n, d] and b [m, d]."""
    from scipy import linalg

    a64, b64 = a.double().numpy(), b.double().numpy()
    mu_a, mu_b = a64.mean(0), b64.mean(0)
    # A small ridge keeps the product's square root defined: ReLU features can be dead (constant).
    ridge = 1e-6 * np.eye(a64.shape[1])
    cov_a, cov_b = np.cov(a64, rowvar=False) + ridge, np.cov(b64, rowvar=False) + ridge
    covmean = linalg.sqrtm(cov_a @ cov_b).real
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(cov_a + cov_b - 2 * covmean))
