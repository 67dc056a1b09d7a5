"""The configuration rules of the models, shared by both tracks: what a Transformer, a GPT, a ViT and a Swin may be
built with, checked before anything is allocated. One rule per model, so that the NumPy and PyTorch models accept
and refuse the same constructor arguments with the same messages.

Each `check_<model>_config(owner, c)` takes the constructor's arguments as a dict and returns a clean copy (sizes
as Python ints, flags as bools): the `config` a model keeps and a checkpoint records.
"""

from __future__ import annotations

import types

import numpy as np

from .pitfalls import LAYER_PITFALLS, MODEL_PITFALLS, check_model_pitfalls
from .validate import check_choice, check_flag, check_probability, check_real, check_size, check_sizes

__all__ = ["TRANSFORMER_ARGS", "TRANSFORMER_POSITIONAL", "FF_ACTIVATIONS", "GPT_NORMS", "GPT_POSITIONAL",
           "GPT_ACTIVATIONS", "GPT_ARGS", "VIT_ARGS", "VIT_POOLS", "SWIN_ARGS", "check_transformer_config",
           "check_gpt_config", "check_patch_embedding", "check_vit_config", "check_swin_config", "check_window_grid",
           "swin_shift", "transformer_options", "own_init", "config_numbers"]  # fmt: skip

# the Transformer's `config` without its pitfall options (chapter 16a adds those that differ from the paper's)
TRANSFORMER_ARGS = ("src_vocab_size", "tgt_vocab_size", "d_model", "n_heads", "d_ff", "n_layers", "dropout", "max_len",
                    "norm_first", "positional", "share_embeddings", "tie_output", "pad_id", "activation",
                    "final_norm")  # fmt: skip
TRANSFORMER_POSITIONAL = ("sinusoidal", "learned")
FF_ACTIVATIONS = ("relu", "gelu")  # the two that torch.nn.TransformerEncoderLayer accepts by name (gelu: exact)
GPT_NORMS = ("layernorm", "rmsnorm")
GPT_POSITIONAL = ("learned", "sinusoidal", "rope")
GPT_ACTIVATIONS = ("gelu", "relu", "swiglu")
# the GPT's `config`: its constructor's arguments but attn_impl, tile_size, rng and dtype (not what the model is)
GPT_ARGS = ("vocab_size", "d_model", "n_heads", "d_ff", "n_layers", "max_len", "dropout", "norm", "positional",
            "activation", "n_kv_heads", "tie_output")  # fmt: skip
VIT_ARGS = ("image_size", "patch_size", "in_channels", "n_classes", "d_model", "n_heads", "d_ff", "n_layers", "dropout",
            "pool")  # fmt: skip
VIT_POOLS = ("cls", "mean")
SWIN_ARGS = ("image_size", "patch_size", "in_channels", "n_classes", "d_model", "depths", "n_heads", "window_size",
             "mlp_ratio", "dropout")  # fmt: skip


def _check_heads(owner: str, c: dict) -> None:
    if c["d_model"] % c["n_heads"]:
        raise ValueError(f"{owner}: d_model={c['d_model']} must be divisible by n_heads={c['n_heads']}")


def _check_sinusoidal(owner: str, c: dict) -> None:
    if c["positional"] == "sinusoidal" and c["d_model"] % 2:
        raise ValueError(f"{owner}: sinusoidal positions need an even d_model, got d_model={c['d_model']}")


def _check_dropout(owner: str, dropout) -> float:
    """A dropout probability in [0, 1): finite, not a bool."""
    p = check_real(owner, "dropout", dropout, 0.0, 1.0)
    if p >= 1:
        raise ValueError(f"{owner}: dropout must be in [0, 1), got {dropout!r}")
    return p


def check_transformer_config(owner: str, c: dict) -> dict:
    """The encoder-decoder Transformer's constructor arguments (chapter 10), validated; messages name the argument."""
    c = dict(c)
    c.update(check_sizes(owner, **{k: c[k] for k in ("src_vocab_size", "tgt_vocab_size", "d_model", "n_heads",
                                                     "d_ff", "n_layers", "max_len")}))  # fmt: skip
    _check_heads(owner, c)
    check_choice(owner, "positional", c["positional"], TRANSFORMER_POSITIONAL)
    _check_sinusoidal(owner, c)
    c["dropout"] = check_probability(owner, "dropout", c["dropout"], allow_one=False)
    check_choice(owner, "activation", c["activation"], FF_ACTIVATIONS)
    for arg in ("norm_first", "share_embeddings", "tie_output"):
        c[arg] = check_flag(owner, arg, c[arg])
    if c["final_norm"] is not None:
        c["final_norm"] = check_flag(owner, "final_norm", c["final_norm"])
    if c["share_embeddings"] and c["src_vocab_size"] != c["tgt_vocab_size"]:
        raise ValueError(
            f"{owner}: share_embeddings=True needs one vocabulary, got src_vocab_size={c['src_vocab_size']} "
            f"and tgt_vocab_size={c['tgt_vocab_size']}"
        )
    pad, n = c["pad_id"], min(c["src_vocab_size"], c["tgt_vocab_size"])
    if isinstance(pad, (bool, np.bool_)) or not isinstance(pad, (int, np.integer)) or not 0 <= pad < n:
        raise ValueError(f"{owner}: pad_id must be an int in [0, {n}) (a token of both vocabularies), got {pad!r}")
    c["pad_id"] = int(pad)
    return c


def check_gpt_config(owner: str, c: dict) -> dict:
    """The GPT's constructor arguments (chapter 17b), validated."""
    c = dict(c)
    c.update(check_sizes(owner, **{k: c[k] for k in ("vocab_size", "d_model", "n_heads", "d_ff", "n_layers",
                                                     "max_len")}))  # fmt: skip
    _check_heads(owner, c)
    c["dropout"] = _check_dropout(owner, c["dropout"])
    check_choice(owner, "norm", c["norm"], GPT_NORMS)
    check_choice(owner, "positional", c["positional"], GPT_POSITIONAL)
    check_choice(owner, "activation", c["activation"], GPT_ACTIVATIONS)
    _check_sinusoidal(owner, c)
    if c["positional"] == "rope" and (c["d_model"] // c["n_heads"]) % 2:
        raise ValueError(f"{owner}: rope needs an even d_head = d_model / n_heads, got {c['d_model'] // c['n_heads']}")
    if c["n_kv_heads"] is not None:
        c["n_kv_heads"] = check_size(owner, "n_kv_heads", c["n_kv_heads"])
        if c["n_heads"] % c["n_kv_heads"]:
            raise ValueError(f"{owner}: n_heads={c['n_heads']} must be divisible by n_kv_heads={c['n_kv_heads']}")
    c["tie_output"] = check_flag(owner, "tie_output", c["tie_output"])
    return c


def _check_patches(owner: str, image_size: int, patch_size: int) -> None:
    if image_size % patch_size:
        raise ValueError(f"{owner}: image_size={image_size} must be divisible by patch_size={patch_size}")


def check_patch_embedding(owner: str, image_size, patch_size, in_channels, d_model) -> None:
    """PatchEmbedding's sizes (ViT's and Swin's first layer): p x p patches that tile the image."""
    check_sizes(owner, image_size=image_size, patch_size=patch_size, in_channels=in_channels, d_model=d_model)
    _check_patches(owner, image_size, patch_size)


def check_vit_config(owner: str, c: dict) -> dict:
    """The ViT's constructor arguments (chapter 19a), validated."""
    check_sizes(owner, **{k: c[k] for k in ("image_size", "patch_size", "in_channels", "n_classes", "d_model",
                                            "n_heads", "d_ff", "n_layers")})  # fmt: skip
    _check_patches(owner, c["image_size"], c["patch_size"])
    _check_heads(owner, c)
    _check_dropout(owner, c["dropout"])
    check_choice(owner, "pool", c["pool"], VIT_POOLS)
    return dict(c)


def check_swin_config(owner: str, c: dict) -> dict:
    """The Swin classifier's constructor arguments (chapter 19b): every stage's token grid must split into whole
    windows, and every stage but the last must have an even grid (patch merging halves it)."""
    check_sizes(owner, **{k: c[k] for k in ("image_size", "patch_size", "in_channels", "n_classes", "d_model",
                                            "window_size", "mlp_ratio")})  # fmt: skip
    _check_patches(owner, c["image_size"], c["patch_size"])
    depths, heads = tuple(c["depths"]), tuple(c["n_heads"])
    if not depths or len(depths) != len(heads):
        raise ValueError(f"{owner}: depths and n_heads must be non-empty and of one length, got {depths}, {heads}")
    for i, (depth, h) in enumerate(zip(depths, heads, strict=True)):
        check_size(owner, f"depths[{i}]", depth)
        check_size(owner, f"n_heads[{i}]", h)
        grid, dim = c["image_size"] // c["patch_size"] // 2**i, c["d_model"] * 2**i
        if dim % h:
            raise ValueError(f"{owner}: stage {i} has d_model {dim}, not divisible by n_heads[{i}]={h}")
        if grid % c["window_size"]:
            raise ValueError(f"{owner}: stage {i} has a {grid}x{grid} token grid, not divisible by "
                             f"window_size={c['window_size']}")  # fmt: skip
        if i < len(depths) - 1 and grid % 2:
            raise ValueError(f"{owner}: stage {i} has an odd {grid}x{grid} grid: patch merging needs an even one")
    _check_dropout(owner, c["dropout"])
    return {**c, "depths": depths, "n_heads": heads}


def check_window_grid(owner: str, H: int, W: int, window_size: int, shift: int = 0) -> None:
    """An H x W grid of tokens that M x M windows (window_size = M) tile, and a shift in [0, M)."""
    check_size(owner, "H", H)
    check_size(owner, "W", W)
    check_size(owner, "window_size", window_size)
    check_size(owner, "shift", shift, minimum=0)
    if H % window_size or W % window_size:
        raise ValueError(f"{owner}: window_size={window_size} must divide H={H} and W={W}")
    if shift >= window_size:
        raise ValueError(f"{owner}: shift must be in [0, window_size={window_size}), got {shift}")


def swin_shift(j: int, window_size: int, grid: int) -> int:
    """Block j of a stage: regular windows for even j, shifted by M // 2 for odd j (none if one window covers all)."""
    return 0 if j % 2 == 0 or window_size >= grid else window_size // 2


def transformer_options(owner: str, args: dict) -> tuple[dict, dict, dict]:
    """The Transformer's constructor arguments (its `locals()`, either track), checked: (config, options, layer
    options). `config` holds TRANSFORMER_ARGS (sizes as Python ints) and the pitfall options (chapter 16a) that
    differ from the paper's; `options` every pitfall option, defaults filled in; the layer options those of
    LAYER_PITFALLS that differ from the paper's (what the stacks pass on to every layer)."""
    config = check_transformer_config(owner, {k: args[k] for k in TRANSFORMER_ARGS})
    config.update(check_model_pitfalls(owner, config["norm_first"], {k: args[k] for k in MODEL_PITFALLS}))
    options = {**MODEL_PITFALLS, **config}
    return config, options, {k: options[k] for k in LAYER_PITFALLS if options[k] != LAYER_PITFALLS[k]}


def own_init(cls: type, **kwdefaults) -> None:
    """Give `cls` its own copy of the constructor it inherits from a shared base, named `cls.__init__`: Python's own
    refusal of a wrong argument ("... got an unexpected keyword argument") then names the class the caller built.
    `kwdefaults` replace the defaults of keyword-only arguments (a track's own dtype: np.float32 in tfm_numpy)."""
    init = cls.__init__
    f = types.FunctionType(init.__code__, init.__globals__, init.__name__, init.__defaults__, init.__closure__)
    f.__kwdefaults__, f.__annotations__ = (init.__kwdefaults__ or {}) | kwdefaults, init.__annotations__
    f.__qualname__ = f"{cls.__name__}.__init__"
    cls.__init__ = f


def _n(c: dict, key: str, default: int = 1) -> int:
    """c[key] if it is an int >= 1 (not a bool), else `default`: `config_numbers` reads a configuration nobody has
    checked yet (a file's), and leaves refusing a malformed one to the constructor's own checks."""
    v = c.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else default


def _ns(c: dict, key: str) -> list[int]:
    v = c.get(key)
    return (
        [i if isinstance(i, int) and not isinstance(i, bool) and i >= 1 else 1 for i in v]
        if isinstance(v, list | tuple)
        else [1]
    )


def config_numbers(model: str, c: dict) -> int | None:
    """A lower bound on how many numbers (parameters, and the tables a model computes rather than stores: sinusoidal
    and rotary positions, Swin's window masks) the constructor of `model` allocates for configuration `c`: integer
    arithmetic, nothing allocated. `model`: "Transformer" (or tfm_torch's "ReferenceTransformer"), "GPT" (or
    "WindowedGPT", "MoEGPT", and "BERT", built of the GPT's blocks), "ViT" or "Swin"; None for another class (one
    that records no configuration, so no file of it is built from its sizes).
    A checkpoint's configuration must not ask for more than the file stores plus a bounded allowance for the tables
    (`npz_checkpoint.check_config_size`), so a 15 KB file that declares vocab_size=10**9 is refused before a model
    is built from it.
    """
    d, n_layers, d_ff, max_len = _n(c, "d_model"), _n(c, "n_layers"), _n(c, "d_ff"), _n(c, "max_len")
    # Transformer: embeddings, positions (a table or weights) in both stacks, feed-forward weights
    if model in ("Transformer", "ReferenceTransformer"):
        return d * (_n(c, "src_vocab_size") + _n(c, "tgt_vocab_size") + 2 * max_len) + 4 * n_layers * d * d_ff
    if model in ("GPT", "WindowedGPT", "MoEGPT", "BERT"):  # rope: a table of d_head / 2 cosines, sines per position
        per_position = d // _n(c, "n_heads") if c.get("positional") == "rope" else d
        return d * _n(c, "vocab_size") + max_len * per_position + n_layers * d * d_ff
    patch, channels, classes = _n(c, "patch_size"), _n(c, "in_channels"), _n(c, "n_classes")
    grid = _n(c, "image_size") // patch  # tokens per side
    if model == "ViT":
        return d * (grid**2 + channels * patch**2 + classes) + 2 * n_layers * d * d_ff
    if model == "Swin":  # per stage: the blocks' feed-forward weights and window masks; stage i has d 2^i, grid / 2^i
        m, ratio = _n(c, "window_size"), _n(c, "mlp_ratio")
        stages = sum(
            depth * 2 * ratio * (d * 2**i) ** 2 + (grid // 2**i * m) ** 2 for i, depth in enumerate(_ns(c, "depths"))
        )
        return d * channels * patch**2 + stages + classes * d
    return None
