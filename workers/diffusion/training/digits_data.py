"""scikit-learn's bundled digits as the embedded image model's data: 1,797 8x8 greyscale images
(values 0..16) of the digits 0-9, scaled to [-1, 1], with one fixed split.

    train    ~1,497 images  the DiT generator and the quality classifier train on these
    heldout     300 images  neither model sees them: the classifier's accuracy on real digits and
                            the real side of the Fréchet distance

The split is stratified by class and seeded, so every run (training, tests, the quality bench)
sees the same images on each side.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

HELDOUT = 300
SPLIT_SEED = 0
NUM_CLASSES = 10
SIDE = 8
MAX_VALUE = 16.0  # load_digits' pixel range is 0..16


@dataclass(frozen=True, kw_only=True)
class DigitsSplit:
    """Images [n, 1, 8, 8] float32 in [-1, 1] and their labels [n] int64."""

    images: torch.Tensor
    labels: torch.Tensor


def to_unit_range(values: np.ndarray) -> np.ndarray:
    """load_digits' 0..16 pixel values -> [-1, 1]."""
    return values / MAX_VALUE * 2.0 - 1.0


@lru_cache(maxsize=1)
def load_split() -> tuple[DigitsSplit, DigitsSplit]:
    """(train, heldout): the fixed stratified split of load_digits."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = to_unit_range(digits.images.astype(np.float32)).reshape(-1, 1, SIDE, SIDE)
    labels = digits.target.astype(np.int64)
    train_idx, heldout_idx = train_test_split(
        np.arange(len(labels)), test_size=HELDOUT, stratify=labels, random_state=SPLIT_SEED
    )
    train = DigitsSplit(images=torch.from_numpy(images[train_idx]), labels=torch.from_numpy(labels[train_idx]))
    heldout = DigitsSplit(images=torch.from_numpy(images[heldout_idx]), labels=torch.from_numpy(labels[heldout_idx]))
    return train, heldout


def train_split() -> DigitsSplit:
    return load_split()[0]


def heldout_split() -> DigitsSplit:
    return load_split()[1]
