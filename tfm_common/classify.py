"""The door of the sequence classifier (chapter 22b), once for both tracks: what `SequenceClassifier(backbone,
n_classes, pool=..., pad_id=...)` is built from and what its forward accepts. The track supplies `_parts`: its Module
class, `Linear`, `as_rng`, `dtype_of(module)` (the parameters' dtype) and `to_numpy(tokens)`.

    tokens (B, T) -> backbone.encode -> hidden states (B, T, d) -> the state at one position per row (B, d)
                  -> head: Linear(d, n_classes) -> logits (B, n_classes)

`pool="first"` reads position 0 (BERT's [CLS]); `pool="last"` reads each row's last token that is not `pad_id` (a
causal GPT's only position that has read the whole text). Rows are right-padded: after a row's first `pad_id`
there is only `pad_id` (with a causal backbone, padding after the last token then changes nothing), and no row is
all padding. `pad_id=None` takes the backbone's `pad_id` if it has one, else every position is a token.
"""

from __future__ import annotations

import numpy as np

from .validate import check_choice, check_size

__all__ = ["SEQUENCE_POOLS", "SequenceClassifierDoor", "check_padding", "check_class_batch"]

SEQUENCE_POOLS = ("first", "last")


def check_padding(owner: str, tokens: np.ndarray, pad_id: int | None) -> None:
    """Token ids (B, T) right-padded with `pad_id`: no row all padding, no token after a row's first pad."""
    if pad_id is None:
        return
    is_pad = tokens == pad_id  # (B, T)
    full = np.flatnonzero(is_pad.all(axis=1))
    if full.size:
        raise ValueError(f"{owner}: row {full[0]} of tokens is all padding (pad_id={pad_id}): there is no token to "
                         "classify from")  # fmt: skip
    after = np.flatnonzero((np.cumsum(is_pad, axis=1) > 0)[:, :] & ~is_pad)  # a token after the row's first pad
    if after.size:
        b, t = divmod(int(after[0]), tokens.shape[1])
        raise ValueError(f"{owner}: tokens must be right-padded, but row {b} has the token {int(tokens[b, t])} at "
                         f"position {t}, after a pad_id={pad_id} (pad at the end of each row)")  # fmt: skip


def check_class_batch(owner: str, tokens, labels, n_classes: int, arrays: tuple[type, ...], words: str, to_numpy):
    """A classifier's batch: tokens (B, T) and labels (B,), arrays of the track (`arrays`, named by `words`), the
    labels integers in [0, n_classes)."""
    if not isinstance(tokens, arrays) or tokens.ndim != 2:
        got = tuple(tokens.shape) if isinstance(tokens, arrays) else type(tokens).__name__
        raise TypeError(f"{owner}: tokens expected {words} of shape (B, T), got {got}")
    if not isinstance(labels, arrays) or tuple(labels.shape) != tuple(tokens.shape[:1]):
        got = tuple(labels.shape) if isinstance(labels, arrays) else type(labels).__name__
        raise ValueError(f"{owner}: labels expected {words} of shape ({tokens.shape[0]},) (one class per row of "
                         f"tokens), got {got}")  # fmt: skip
    y = to_numpy(labels)
    if y.dtype == np.bool_ or not np.issubdtype(y.dtype, np.integer):
        raise TypeError(f"{owner}: labels expected integer class ids, got dtype {y.dtype}")
    bad = (y < 0) | (y >= n_classes)
    if bad.any():
        raise ValueError(f"{owner}: labels must be in [0, {n_classes}) (n_classes), got {y[bad][0]}")


class SequenceClassifierDoor:
    """The constructor and the forward's checks of `SequenceClassifier` (either track)."""

    def __init__(self, backbone, n_classes: int, *, pool: str = "first", pad_id: int | None = None, rng=None):
        """backbone (a module of this track with `encode(tokens)` -> (B, T, d_model) and `d_model`), then head, a
        Linear(d_model, n_classes) in the backbone's dtype, initialized from `rng` as every Linear."""
        super().__init__()
        parts, owner = self._parts, "SequenceClassifier"
        if not isinstance(backbone, parts.Module) or not callable(getattr(backbone, "encode", None)):
            raise TypeError(f"{owner}: backbone expected a model of this track with encode(tokens) -> hidden states "
                            f"(a GPT or a BERT), got {type(backbone).__name__}")  # fmt: skip
        n_classes = check_size(owner, "n_classes", n_classes)
        check_choice(owner, "pool", pool, SEQUENCE_POOLS)
        if pad_id is None:
            pad_id = getattr(backbone, "pad_id", None)
        vocab_size = getattr(backbone, "vocab_size", None)
        if pad_id is not None:
            pad_id = check_size(owner, "pad_id", pad_id, minimum=0)
            if vocab_size is not None and pad_id >= vocab_size:
                raise ValueError(f"{owner}: pad_id must be a token of the backbone's vocabulary, in [0, {vocab_size})"
                                 f", got {pad_id}")  # fmt: skip
        d_model = check_size(owner, "backbone.d_model", getattr(backbone, "d_model", None))
        self.pool, self.pad_id, self.n_classes, self.d_model = pool, pad_id, n_classes, d_model
        self.backbone = backbone
        self.head = parts.Linear(d_model, n_classes, rng=parts.as_rng(rng), dtype=parts.dtype_of(backbone))

    def _check_forward(self, tokens) -> None:
        check = getattr(self.backbone, "_check_encode", None) or self.backbone._check_forward
        check(tokens)  # the backbone's own door: an integer (B, T) array of its vocabulary that fits max_len
        check_padding("SequenceClassifier", self._parts.to_numpy(tokens), self.pad_id)

    def extra_repr(self) -> str:
        return f"n_classes={self.n_classes}, pool={self.pool!r}, pad_id={self.pad_id!r}"
