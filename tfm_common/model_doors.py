"""The doors of the GPT, ViT and Swin modules, with their reprs and `attention_weights`, once for both tracks (as
`tfm_common.doors` holds the 2017 model's): the track supplies `_check_float` (its check_input), `_check_ids` (its
check_indices) and, for WindowAttention, the mask's `_mask_kind` = (array type, bool dtype, word). The attention
weights are the last forward's (detached in tfm_torch). The constructors of the GPT, PatchEmbedding, ViT, Swin,
WindowAttention, SwinBlock and PatchMerging are written here once too, from the track's building blocks `_parts` (as
`tfm_common.doors`' layers are).
"""

from __future__ import annotations

from .config import (
    GPT_ARGS,
    SWIN_ARGS,
    VIT_ARGS,
    check_gpt_config,
    check_patch_embedding,
    check_swin_config,
    check_vit_config,
    check_window_grid,
    swin_shift,
)
from .rolling_cache import check_window_options
from .sampling import check_generate, check_token_window
from .validate import check_choice, check_flag, check_size

KV_DTYPES = ("float", "int8")  # how a GPT's key/value cache keeps its numbers (GPT.new_cache, GPT.generate)

__all__ = ["GPTBlockDoor", "GPTDoor", "WindowedGPTDoor", "PatchEmbeddingDoor", "ImageModelDoor", "ViTDoor", "SwinDoor",
           "WindowAttentionDoor", "SwinBlockDoor", "PatchMergingDoor"]  # fmt: skip


class GPTBlockDoor:
    """What the block's inner norm and attention refused of a caller's x and mask (inner calls skip their checks)."""

    def _check_forward(self, x, mask=None, offset=0) -> None:
        self.norm1._check_forward(x)
        self.self_attn._check_forward(x, mask, offset)

    def _check_forward_step(self, x, cache, mask=None) -> None:
        self.norm1._check_forward(x)
        self.self_attn._check_forward_step(x, cache, mask)


class GPTDoor:
    """Token ids in the vocabulary that fit the context window after the cached positions; generate's arguments."""

    def __new__(cls, *args, window=None, **kwargs):
        """GPT(..., window=w) builds the track's WindowedGPT (sliding-window attention and the rolling cache, chapter
        21c): the GPT of chapter 17b stays the full causal model; window=None keeps the class asked for."""
        if window is not None and not issubclass(cls, cls._windowed):
            cls = cls._windowed
        return super().__new__(cls)

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_heads: int,
        d_ff: int,
        n_layers: int,
        max_len: int,
        dropout: float = 0.0,
        *,
        norm: str = "layernorm",
        positional: str = "learned",
        activation: str = "gelu",
        n_kv_heads: int | None = None,
        tie_output: bool = True,
        attn_impl: str = "explicit",
        tile_size: int = 64,
        window: int | None = None,
        sinks: int = 0,
        rng=None,
        dtype=None,
    ):
        """embed, pos (None for rope), dropout, layers (n_layers GPTBlocks, sharing one RotaryEmbedding for rope),
        norm and output_projection, registered in that order, then initialized as GPT's docstring says. `window`
        and `sinks` (chapter 21c) are in `config` only when a window is set (a GPT(window=w) is a WindowedGPT)."""
        super().__init__()
        self.config = c = check_gpt_config("GPT", {k: v for k, v in locals().items() if k in GPT_ARGS})
        self.window, self.sinks = check_window_options("GPT", window, sinks)
        if (self.window is None) == isinstance(self, self._windowed):
            raise ValueError(f"{type(self).__name__}: window expected an int >= 1 (a WindowedGPT has a window; "
                             f"GPT(..., window=w) builds one), got window={window!r}")  # fmt: skip
        if self.window is not None:
            c.update(window=self.window, sinks=self.sinks)
        parts = self._parts
        attn_impl, tile_size = parts.check_attn_impl("GPT", attn_impl, tile_size)  # refused before anything is built
        self.vocab_size, self.d_model, self.max_len = c["vocab_size"], c["d_model"], c["max_len"]
        dt, rng = parts.check_dtype(dtype), parts.as_rng(rng)
        self.embed = parts.Embedding(self.vocab_size, self.d_model, rng=rng, dtype=dt)
        parts.scale_(self.embed.weight, self.d_model**-0.5)  # N(0, 1) -> N(0, 1/d_model)
        if positional == "learned":
            self.pos = parts.LearnedPositionalEmbedding(self.max_len, self.d_model, rng=rng, dtype=dt)
        elif positional == "sinusoidal":
            self.pos = parts.PositionalEncoding(self.d_model, self.max_len, dtype=dt)
        else:
            self.pos = None  # rope: the positions live in the attention
        self.dropout = parts.Dropout(c["dropout"], rng=rng)
        rotary = parts.RotaryEmbedding(d_model // n_heads, self.max_len, dtype=dt) if positional == "rope" else None
        block = dict(norm=norm, activation=activation, n_kv_heads=c["n_kv_heads"], rotary=rotary, rng=rng, dtype=dt)
        blocks = (parts.GPTBlock(d_model, n_heads, d_ff, c["dropout"], **block) for _ in range(n_layers))
        self.layers = parts.ModuleList(blocks)
        self.norm = parts.make_norm(norm, d_model, dt)
        self.output_projection = parts.Linear(d_model, self.vocab_size, bias=False, rng=rng, dtype=dt)  # (V, d)
        if c["tie_output"]:
            self.output_projection.weight = self.embed.weight  # one Parameter: logits = h @ E^T
        else:
            parts.xavier_uniform_(self.output_projection.weight, rng)
        for _, p in self.layers.named_parameters():
            if p.data.ndim == 2:
                parts.xavier_uniform_(p, rng)
        parts.use_attention(self, attn_impl, tile_size)  # how every block computes its heads (not a weight)

    def _check_forward(self, tokens) -> None:
        self._check_tokens(tokens, 0)

    def _check_forward_step(self, tokens, cache: dict) -> None:
        """cache: a dict, empty at the first call, then what this model's forward_step filled for this batch."""
        owner = "GPT.forward_step"
        if not isinstance(cache, dict):
            raise TypeError(f"{owner}: cache expected a dict (empty at the first call), got {type(cache).__name__}")
        length = check_size(owner, "cache['length']", cache.get("length", 0), minimum=0)
        self._check_tokens(tokens, length)
        layers, attn = cache.get("layers", [{}] * len(self.layers) if length == 0 else None), self.layers[0].self_attn
        if not isinstance(layers, list) or len(layers) != len(self.layers):
            got = f"{len(layers)} layers" if isinstance(layers, list) else f"layers {type(layers).__name__}"
            raise ValueError(f"{owner}: the cache holds {got} for length {length}, this model has {len(self.layers)}"
                             " layers: a cache from another model; start a new cache ({})")  # fmt: skip
        want = (tokens.shape[0], attn.n_kv_heads, length, attn.d_head)
        for i, layer in enumerate(layers):
            got = [tuple(layer[n].shape) for n in ("k", "v") if isinstance(layer, dict) and n in layer]
            if got != [want, want] and not (length == 0 and layer in ({}, {"kv_dtype": "int8"})):
                raise ValueError(f"{owner}: layer {i} of the cache holds keys and values {got}, expected (B, "
                                 f"n_kv_heads, length, d_head) = {want}: a cache from another model or batch; "
                                 "start a new cache ({})")  # fmt: skip

    def _check_generate(self, tokens, max_new_tokens, temperature, top_k, rng, use_cache, top_p=None,
                        kv_dtype="float"):  # fmt: skip
        """(max_new_tokens, temperature, top_k, a numpy Generator, top_p), checked with the prompt, use_cache and
        kv_dtype."""
        T0 = self._check_tokens(tokens, 0)
        check_flag("GPT.generate", "use_cache", use_cache)
        check_choice("GPT.generate", "kv_dtype", kv_dtype, KV_DTYPES)
        return check_generate("GPT.generate", T0, max_new_tokens, temperature, top_k, rng, self.vocab_size,
                              self._generate_positions(T0, max_new_tokens, use_cache), top_p)  # fmt: skip

    def _generate_positions(self, T0, max_new_tokens, use_cache) -> int:
        """How many positions generate may reach: max_len (a WindowedGPT's rolling cache: more, see its door)."""
        return self.max_len

    def new_cache(self, kv_dtype: str = "float") -> dict:
        """An empty cache for `forward_step`: {} keeps the keys and values as floats (the model's dtype); "int8"
        keeps them as int8 codes with one scale per (position, head) (`kv_cache.store_kv`), a quarter of float32's
        bytes plus the scales."""
        check_choice("GPT.new_cache", "kv_dtype", kv_dtype, KV_DTYPES)
        return {} if kv_dtype == "float" else {"layers": [{"kv_dtype": kv_dtype} for _ in self.layers]}

    def _check_tokens(self, tokens, offset: int) -> int:
        self._check_ids("GPT: tokens", tokens, self.vocab_size)
        return check_token_window("GPT", tuple(tokens.shape), offset, self.max_len)

    def attention_weights(self) -> list:
        """[(B, H, T, T) per layer]: the last forward's self-attention weights."""
        return [layer.self_attn.attn_weights for layer in self.layers]

    def extra_repr(self) -> str:
        c = self.config
        keys = ("norm", "positional", "activation", "n_kv_heads", "tie_output") + ("window", "sinks") * ("window" in c)
        return ", ".join(f"{k}={c[k]!r}" for k in keys)


class WindowedGPTDoor:
    """A WindowedGPT's rolling cache (chapter 21c): with RoPE, positions past max_len; its own cache layout."""

    def _generate_positions(self, T0, max_new_tokens, use_cache) -> int:
        """The rolling cache lets a RoPE model generate past max_len; nothing else does (refused, saying why)."""
        need = T0 + max_new_tokens - 1
        if need <= self.max_len or not isinstance(max_new_tokens, int):
            return self.max_len  # check_generate checks the rest
        if self.config["positional"] != "rope":
            raise ValueError(f"GPT.generate: a prompt of {T0} tokens and max_new_tokens={max_new_tokens} need {need} "
                             f"positions, more than max_len={self.max_len}: only positional='rope' runs past max_len "
                             f"(its rotations are computed for any position); this model has positional="
                             f"{self.config['positional']!r}, a table of max_len positions")  # fmt: skip
        if not use_cache:
            raise ValueError(f"GPT.generate: use_cache=False re-runs the whole sequence, at most max_len="
                             f"{self.max_len} positions; {need} need the rolling cache (use_cache=True)")  # fmt: skip
        return need

    def _check_forward_step(self, tokens, cache: dict) -> None:
        """cache: a dict, empty at the first call (or new_cache's), then what this model's forward_step filled."""
        owner = "GPT.forward_step"
        if not isinstance(cache, dict):
            raise TypeError(f"{owner}: cache expected a dict (empty at the first call), got {type(cache).__name__}")
        length = check_size(owner, "cache['length']", cache.get("length", 0), minimum=0)
        self._check_ids("GPT: tokens", tokens, self.vocab_size)
        if self.config["positional"] == "rope":
            check_token_window("GPT", tuple(tokens.shape), 0, self.max_len)  # a call's tokens; the positions: any
        else:
            check_token_window("GPT", tuple(tokens.shape), length, self.max_len)
        attn, size = self.layers[0].self_attn, self.sinks + self.window
        want = (tokens.shape[0], attn.n_kv_heads, size, attn.d_head)
        layers = cache.get("layers", [{}] * len(self.layers))
        if not isinstance(layers, list) or len(layers) != len(self.layers):
            raise ValueError(f"{owner}: the cache's layers do not match this model's {len(self.layers)} layers: a "
                             "cache from another model; start a new cache ({})")  # fmt: skip
        for i, layer in enumerate(layers):
            got = [tuple(layer[n].shape) for n in ("k", "v") if isinstance(layer, dict) and n in layer]
            if got != [want, want] and not (length == 0 and layer in ({}, {"kv_dtype": "int8"})):
                raise ValueError(f"{owner}: layer {i} of the cache holds keys and values {got}, expected the rolling "
                                 f"cache's (B, n_kv_heads, sinks + window, d_head) = {want}: a cache from another "
                                 "model or batch; start a new cache ({})")  # fmt: skip


class PatchEmbeddingDoor:
    """Images (B, C, S, S) of the parameters' dtype (the door of ViT and Swin too, which hand them straight here)."""

    def __init__(self, image_size: int, patch_size: int, in_channels: int, d_model: int, *, rng=None, dtype=None):
        """proj: one Linear (C p p -> d_model) on the flattened patches."""
        super().__init__()
        check_patch_embedding("PatchEmbedding", image_size, patch_size, in_channels, d_model)
        self.image_size, self.patch_size, self.in_channels, self.d_model = image_size, patch_size, in_channels, d_model
        self.grid = image_size // patch_size
        self.n_patches = self.grid * self.grid
        n_in, parts = in_channels * patch_size * patch_size, self._parts
        self.proj = parts.Linear(n_in, d_model, rng=parts.as_rng(rng), dtype=parts.check_dtype(dtype))

    def _check_forward(self, images) -> None:
        self._check_float("PatchEmbedding", images, ndim_min=4, dtype=self.proj.weight.dtype)
        C, S = self.in_channels, self.image_size
        if len(images.shape) != 4 or tuple(images.shape[1:]) != (C, S, S):
            raise ValueError(f"PatchEmbedding: images expected shape (B, {C}, {S}, {S}), got {tuple(images.shape)}")

    def extra_repr(self) -> str:
        return f"image_size={self.image_size}, patch_size={self.patch_size}, n_patches={self.n_patches}"


class ImageModelDoor:
    """A ViT or Swin checks what its patch embedding checks."""

    def _check_forward(self, images) -> None:
        self.patch_embed._check_forward(images)


class ViTDoor(ImageModelDoor):
    def __init__(
        self,
        image_size: int,
        patch_size: int,
        in_channels: int,
        n_classes: int,
        d_model: int,
        n_heads: int,
        d_ff: int,
        n_layers: int,
        dropout: float = 0.0,
        *,
        pool: str = "cls",
        rng=None,
        dtype=None,
    ):
        """patch_embed, cls_token (pool="cls" only), pos_embed, dropout, encoder (Pre-LN, GELU, final norm) and head,
        registered in that order; the class token and the positions start N(0, 0.02^2)."""
        super().__init__()
        self.config = check_vit_config("ViT", {k: v for k, v in locals().items() if k in VIT_ARGS})
        parts = self._parts
        dt, rng = parts.check_dtype(dtype), parts.as_rng(rng)
        self.pool, self.d_model = pool, d_model
        self.patch_embed = parts.PatchEmbedding(image_size, patch_size, in_channels, d_model, rng=rng, dtype=dt)
        n_tokens = self.patch_embed.n_patches + (pool == "cls")
        self.cls_token = parts.normal_parameter((1, 1, d_model), 0.02, rng, dt) if pool == "cls" else None
        self.pos_embed = parts.LearnedPositionalEmbedding(n_tokens, d_model, rng=rng, dtype=dt)
        parts.scale_(self.pos_embed.weight, 0.02)  # N(0, 1) -> N(0, 0.02^2)
        self.dropout = parts.Dropout(dropout, rng=rng)
        layers = (n_layers, d_model, n_heads, d_ff, dropout, "gelu")
        self.encoder = parts.Encoder(*layers, norm_first=True, rng=rng, dtype=dt)
        self.head = parts.Linear(d_model, n_classes, rng=rng, dtype=dt)

    def attention_weights(self) -> list:
        """[(B, H, T, T) per layer] from the last forward; with pool="cls", token 0 is the class token."""
        return self.encoder.attention_weights()

    def extra_repr(self) -> str:
        return f"pool={self.pool!r}, n_patches={self.patch_embed.n_patches}"


class SwinDoor(ImageModelDoor):
    def __init__(
        self,
        image_size: int,
        patch_size: int,
        in_channels: int,
        n_classes: int,
        d_model: int,
        depths=(2, 2),
        n_heads=(2, 4),
        window_size: int = 4,
        mlp_ratio: int = 2,
        dropout: float = 0.0,
        *,
        rng=None,
        dtype=None,
    ):
        super().__init__()
        self.config = c = check_swin_config("Swin", {k: v for k, v in locals().items() if k in SWIN_ARGS})
        parts = self._parts
        dt, rng = parts.check_dtype(dtype), parts.as_rng(rng)
        self.patch_embed = parts.PatchEmbedding(image_size, patch_size, in_channels, d_model, rng=rng, dtype=dt)
        self.dropout = parts.Dropout(dropout, rng=rng)
        self.stages, self.merges = parts.ModuleList(), parts.ModuleList()
        grid, dim = image_size // patch_size, d_model
        for i, (depth, heads) in enumerate(zip(c["depths"], c["n_heads"], strict=True)):
            shifts = [swin_shift(j, window_size, grid) for j in range(depth)]  # 0, M/2, 0, M/2, ...
            block = dict(resolution=(grid, grid), window_size=window_size, dropout=dropout, rng=rng, dtype=dt)
            blocks = [parts.SwinBlock(dim, heads, mlp_ratio * dim, shift=shift, **block) for shift in shifts]
            self.stages.append(parts.ModuleList(blocks))
            if i < len(c["depths"]) - 1:
                self.merges.append(parts.PatchMerging((grid, grid), dim, rng=rng, dtype=dt))
                grid, dim = grid // 2, dim * 2
        self.norm = parts.LayerNorm(dim, dtype=dt)
        self.head = parts.Linear(dim, n_classes, rng=rng, dtype=dt)

    def _check_forward(self, images) -> None:
        super()._check_forward(images)
        refuse_empty_batch("Swin", "images", tuple(images.shape))

    def attention_weights(self) -> list:
        """[(B nW, heads, M M, M M) per block] from the last forward."""
        return [block.attn.attn_weights for stage in self.stages for block in stage]


class WindowAttentionDoor:
    def __init__(self, d_model: int, n_heads: int, window_size: int, dropout: float = 0.0, *, rng=None, dtype=None):
        """q_proj, k_proj, v_proj, out_proj, relative_position_bias_table ((2M-1)^2, n_heads), N(0, 0.02^2), the
        constant `index` (not a state_dict key) and `dropout` on the attention weights, registered in that order."""
        super().__init__()
        check_size("WindowAttention", "d_model", d_model)
        check_size("WindowAttention", "n_heads", n_heads)
        M = check_size("WindowAttention", "window_size", window_size)
        if d_model % n_heads:
            raise ValueError(f"WindowAttention: d_model={d_model} must be divisible by n_heads={n_heads}")
        self.d_model, self.n_heads, self.d_head, self.window_size = d_model, n_heads, d_model // n_heads, M
        parts = self._parts
        dt, rng = parts.check_dtype(dtype), parts.as_rng(rng)
        self.q_proj = parts.Linear(d_model, d_model, rng=rng, dtype=dt)
        self.k_proj = parts.Linear(d_model, d_model, rng=rng, dtype=dt)
        self.v_proj = parts.Linear(d_model, d_model, rng=rng, dtype=dt)
        self.out_proj = parts.Linear(d_model, d_model, rng=rng, dtype=dt)
        self.relative_position_bias_table = parts.normal_parameter(((2 * M - 1) ** 2, n_heads), 0.02, rng, dt)
        parts.keep_constant(self, "index", parts.relative_position_index(M))  # (M M, M M)
        self.dropout = parts.Dropout(dropout, rng=rng)  # on the attention weights
        self.attn_weights = None

    def _check_forward(self, x, mask=None) -> None:
        """x (B nW, M M, d_model); mask None or a bool (nW, M M, M M) whose nW divides B nW."""
        N, (array, boolean, word) = self.window_size**2, self._mask_kind
        self._check_float("WindowAttention", x, ndim_min=3, last_dim=self.d_model, dtype=self.q_proj.weight.dtype)
        if len(x.shape) != 3 or x.shape[1] != N:
            raise ValueError(f"WindowAttention: x expected shape (B nW, {N}, {self.d_model}), got {tuple(x.shape)}")
        if mask is None:
            return
        if not isinstance(mask, array) or mask.dtype != boolean or len(mask.shape) != 3 or mask.shape[1:] != (N, N):
            got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, array) else type(mask).__name__
            raise ValueError(f"WindowAttention: mask expected a bool {word} (nW, {N}, {N}), got {got}")
        if x.shape[0] % mask.shape[0]:
            raise ValueError(f"WindowAttention: {x.shape[0]} windows is not a multiple of the mask's {mask.shape[0]}")

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_heads={self.n_heads}, window_size={self.window_size}"


class GridDoor:
    """x (B, H W, d_model): the module's grid of tokens, of its norm's dtype (`_owner` and `_norm` name them)."""

    def _check_forward(self, x) -> None:
        (H, W), d, owner = self.resolution, self.d_model, self._owner
        self._check_float(owner, x, ndim_min=3, last_dim=d, dtype=getattr(self, self._norm).weight.dtype)
        if len(x.shape) != 3 or x.shape[1] != H * W:
            raise ValueError(f"{owner}: x expected shape (B, {H * W}, {d}), got {tuple(x.shape)}")


def refuse_empty_batch(owner: str, arg: str, shape: tuple[int, ...]) -> None:
    """Swin's blocks view their rows as (B, H, W, d), a reshape that cannot infer d from no rows: an empty batch is
    refused (in both tracks alike), where the ViT and the GPT return an empty result."""
    if shape[0] == 0:
        raise ValueError(f"{owner}: {arg} expected a batch of at least one (B >= 1), got shape {shape}")


class SwinBlockDoor(GridDoor):
    _owner, _norm = "SwinBlock", "norm1"

    def _check_forward(self, x) -> None:
        super()._check_forward(x)
        refuse_empty_batch("SwinBlock", "x", tuple(x.shape))

    def __init__(self, d_model: int, n_heads: int, d_ff: int, resolution: tuple[int, int], window_size: int,
                 shift: int = 0, dropout: float = 0.0, *, rng=None, dtype=None):  # fmt: skip
        super().__init__()
        H, W = resolution
        check_window_grid("SwinBlock", H, W, window_size, shift)
        check_size("SwinBlock", "d_ff", d_ff)
        parts = self._parts
        dt, rng = parts.check_dtype(dtype), parts.as_rng(rng)
        self.d_model, self.resolution, self.window_size, self.shift = d_model, (H, W), window_size, shift
        self.norm1 = parts.LayerNorm(d_model, dtype=dt)
        self.attn = parts.WindowAttention(d_model, n_heads, window_size, dropout, rng=rng, dtype=dt)
        self.norm2 = parts.LayerNorm(d_model, dtype=dt)
        self.ff = parts.PositionwiseFeedForward(d_model, d_ff, dropout, "gelu", rng=rng, dtype=dt)
        self.dropout1 = parts.Dropout(dropout, rng=rng)
        self.dropout2 = parts.Dropout(dropout, rng=rng)
        mask = parts.shifted_window_mask(H, W, window_size, shift) if shift else None  # (nW, M M, M M)
        parts.keep_constant(self, "mask", mask)  # built once, at construction (tfm_torch: a buffer, not saved)

    def extra_repr(self) -> str:
        return f"resolution={self.resolution}, window_size={self.window_size}, shift={self.shift}"


class PatchMergingDoor(GridDoor):
    _owner, _norm = "PatchMerging", "norm"

    def __init__(self, resolution: tuple[int, int], d_model: int, *, rng=None, dtype=None):
        super().__init__()
        H, W = resolution
        check_size("PatchMerging", "d_model", d_model)
        if check_size("PatchMerging", "H", H) % 2 or check_size("PatchMerging", "W", W) % 2:
            raise ValueError(f"PatchMerging: resolution must be even, got {resolution}")
        dt = self._parts.check_dtype(dtype)
        self.resolution, self.d_model = (H, W), d_model
        self.norm = self._parts.LayerNorm(4 * d_model, dtype=dt)
        self.reduction = self._parts.Linear(4 * d_model, 2 * d_model, bias=False, rng=self._parts.as_rng(rng), dtype=dt)

    def extra_repr(self) -> str:
        return f"resolution={self.resolution}, d_model={self.d_model}"
