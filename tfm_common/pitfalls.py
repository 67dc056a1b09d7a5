"""The options that reproduce choices of popular Transformer code (chapter 16a), defined once for both tracks.

Each option's default changes nothing; the other values are the deviations the chapter measures. The defaults
are the paper's choices but one, which is not in the paper's text: `ff_dropout=True` (dropout on the
feed-forward's hidden units) comes, like the dropout on the attention weights that every attention of the model
gets (its `dropout`, the model's rate), from the tensor2tensor code and the PyTorch and Annotated Transformer
layers that follow it; the paper (section 5.4) names only the sublayer outputs and the embedding sums. Chapter
16a measures both.

`check_model_pitfalls` validates a Transformer's options and returns only those that differ
from the defaults, so that a model built without them keeps exactly its former configuration (and checkpoints).
"""

from __future__ import annotations

from .validate import check_choice, check_flag

__all__ = [
    "SCORE_SCALES",
    "HEAD_PROJECTIONS",
    "DROPOUT_PLACES",
    "EMBED_SCALES",
    "LAYER_PITFALLS",
    "MODEL_PITFALLS",
    "check_layer_pitfalls",
    "check_model_pitfalls",
]

SCORE_SCALES = ("d_k", "d_model")  # scores / sqrt(d_k) (the paper) or / sqrt(d_model)
HEAD_PROJECTIONS = ("full", "shared")  # (d_model, d_model) projections, or one (d_k, d_k) shared by the heads
DROPOUT_PLACES = ("sublayer", "after_norm")  # norm(x + dropout(f(x))) (the paper) or dropout(norm(x + f(x)))
EMBED_SCALES = ("embedding", "logits", "none")  # where sqrt(d_model) goes: see the Transformer's docstring

# keyword-only options of EncoderLayer / DecoderLayer (and their stacks), with their defaults
# (ff_dropout=True: tensor2tensor's and torch.nn.TransformerEncoderLayer's hidden dropout, not the paper's text)
LAYER_PITFALLS = {"score_scale": "d_k", "head_projection": "full", "dropout_place": "sublayer", "ff_dropout": True}
# ... and the Transformer's own
MODEL_PITFALLS = {**LAYER_PITFALLS, "embed_scale": "embedding", "embed_norm": False, "tgt_padding_mask": True}

_CHOICES = {
    "score_scale": SCORE_SCALES,
    "head_projection": HEAD_PROJECTIONS,
    "dropout_place": DROPOUT_PLACES,
    "embed_scale": EMBED_SCALES,
}


def check_layer_pitfalls(owner: str, norm_first: bool, dropout_place="sublayer", ff_dropout=True) -> tuple[str, bool]:
    """An encoder or decoder layer's own options: where the residual dropout sits, whether the feed-forward's hidden
    units get one. Moving the dropout after the LayerNorm needs a LayerNorm after the sum: Post-LN."""
    dropout_place = check_choice(owner, "dropout_place", dropout_place, DROPOUT_PLACES)
    if norm_first and dropout_place == "after_norm":
        raise ValueError(f"{owner}: dropout_place='after_norm' needs Post-LN (norm_first=False), got norm_first=True")
    return dropout_place, check_flag(owner, "ff_dropout", ff_dropout)


def check_model_pitfalls(owner: str, norm_first: bool, options: dict) -> dict:
    """Validate the pitfall options (names as MODEL_PITFALLS); return the ones that differ from the defaults."""
    unknown = sorted(set(options) - set(MODEL_PITFALLS))
    if unknown:
        raise TypeError(f"{owner}: unknown option(s) {unknown}; expected some of {sorted(MODEL_PITFALLS)}")
    out = {}
    for name, value in options.items():
        if name in _CHOICES:
            value = check_choice(owner, name, value, _CHOICES[name])
        else:
            value = check_flag(owner, name, value)
        if value != MODEL_PITFALLS[name]:
            out[name] = value
    check_layer_pitfalls(owner, norm_first, out.get("dropout_place", "sublayer"))
    return out
