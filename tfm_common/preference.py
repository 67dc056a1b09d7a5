"""Preference optimization (chapter 22d), what both tracks share (NumPy only, never torch): the checks of DPO's
arguments, its result types, and a task whose preferences a program can verify.

DPO (Rafailov et al., 2023) trains a policy pi_theta on pairs (x, y_w, y_l), a prompt with a chosen and a rejected
answer, against a frozen reference pi_ref (the supervised model it starts from):

    r(x, y) = beta * (log pi_theta(y | x) - log pi_ref(y | x))          the implicit reward
    L       = -mean log sigmoid(r(x, y_w) - r(x, y_l))                   over the pairs

The task is string reversal (chapter 11's `reverse_task`) written as text for a decoder-only model:

    <bos> c a b d = d b a c <eos>        prompt: <bos> s "="; response: reversed(s) <eos>

A response is right when it is exactly reversed(s) followed by <eos>: no person is asked, a comparison decides.
The pieces: `ReversalTask` (the vocabulary, prompts, responses, the check), `sft_batch` (supervised windows with the
prompt masked out of the loss), `sample_answers` (answers of any model, grouped by prompt length), `preference_pairs`
(two answers per prompt, the right one chosen, kept only where exactly one is right) and `preference_batch` (chosen
and rejected sequences padded into one array, with the mask of their response tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from .data import BOS_ID, EOS_ID, PAD_ID, SYMBOLS, Vocab, reverse_task
from .validate import check_real, check_size

__all__ = [
    "DPOResult",
    "DPOStepResult",
    "PreferenceBatch",
    "check_beta",
    "check_dpo_shapes",
    "check_sequence_shapes",
    "check_mask_rows",
    "check_batch_mask",
    "ReversalTask",
    "sft_batch",
    "sample_answers",
    "preference_pairs",
    "preference_batch",
    "response_batch",
    "reference_is_frozen",
]


class DPOResult(NamedTuple):
    """What `dpo_loss` returns (arrays in tfm_numpy, tensors in tfm_torch): the mean loss, the implicit rewards
    beta (log pi - log pi_ref) of the chosen and of the rejected answers (B,), and their difference, the margins (B,).
    """

    loss: object
    chosen_rewards: object
    rejected_rewards: object
    margins: object


class DPOStepResult(NamedTuple):
    """One DPO update, as floats: the loss before it, the gradient norm before clipping, the mean implicit rewards,
    the mean margin, and the fraction of pairs whose margin is positive (the reward model's accuracy)."""

    loss: float
    grad_norm: float
    chosen_reward: float
    rejected_reward: float
    margin: float
    reward_accuracy: float


class PreferenceBatch(NamedTuple):
    """B pairs as 2B sequences: rows 0..B-1 the chosen answers, rows B..2B-1 the rejected ones, same prompts.

    tokens (2B, T) the model's input, targets (2B, T) the next tokens (targets[:, t] = sequence[t + 1]),
    mask (2B, T) True where the target is a response token (prompt and padding False)."""

    tokens: np.ndarray
    targets: np.ndarray
    mask: np.ndarray


def check_beta(name: str, beta) -> float:
    """beta > 0, finite: the strength of the pull back to the reference (beta = 0 would erase the loss)."""
    beta = check_real(name, "beta", beta, nonfinite=ValueError)
    if not beta > 0:
        raise ValueError(f"{name}: beta must be > 0 (the KL strength; typical 0.1-0.5), got {beta}")
    return beta


def check_dpo_shapes(name: str, shapes: dict[str, tuple[int, ...]]) -> None:
    """The four log-probability arrays of `dpo_loss`: each 1-D (B,) with B >= 1, all the same shape."""
    for arg, shape in shapes.items():
        if len(shape) != 1 or shape[0] < 1:
            raise ValueError(f"{name}: {arg} expected shape (B,) with B >= 1 (one log-probability per pair), "
                             f"got {shape}")  # fmt: skip
    first, want = next(iter(shapes.items()))
    for arg, shape in shapes.items():
        if shape != want:
            raise ValueError(f"{name}: {arg} expected shape {want} (as {first}), got {shape}")


def check_sequence_shapes(name: str, logits: tuple[int, ...], targets: tuple[int, ...], mask: tuple[int, ...]):
    """`sequence_logps`: logits (B, T, V), targets and mask (B, T)."""
    if len(logits) != 3:
        raise ValueError(f"{name}: logits expected shape (B, T, V), got {logits}")
    for arg, shape in (("targets", targets), ("mask", mask)):
        if shape != logits[:2]:
            raise ValueError(f"{name}: {arg} expected shape {logits[:2]} (logits without V), got {shape}")


def check_mask_rows(name: str, counts: np.ndarray) -> None:
    """Every row of the response mask selects at least one token (a response ends with <eos>, at least)."""
    empty = np.flatnonzero(counts == 0)
    if empty.size:
        raise ValueError(f"{name}: mask row {int(empty[0])} selects no token; every sequence needs at least one "
                         "response token (its <eos>)")  # fmt: skip


def check_batch_mask(name: str, tokens_shape: tuple[int, ...], mask) -> None:
    """A `PreferenceBatch`'s mask: boolean (2B, T) like its tokens, every row with a response token."""
    if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_ or mask.shape != tuple(tokens_shape):
        raise ValueError(f"{name}: mask expected a boolean array of shape {tuple(tokens_shape)}, got "
                         f"{getattr(mask, 'dtype', type(mask).__name__)} {getattr(mask, 'shape', '')}")  # fmt: skip
    check_mask_rows(name, mask.sum(axis=-1))


def reference_is_frozen(name: str, policy_params, reference_params, optimizer_params) -> None:
    """The mistake readers report: the reference is the policy itself, or is being trained along with it. Either
    way the log-ratios measure the policy against itself and the loss cannot tell how far it has moved."""
    policy, reference = {id(p) for p in policy_params}, {id(p) for p in reference_params}
    if policy & reference:
        raise ValueError(f"{name}: the reference shares parameters with the policy; DPO needs a frozen copy "
                         "(copy.deepcopy(policy) before training), not the policy itself")  # fmt: skip
    if reference & {id(p) for p in optimizer_params}:
        raise ValueError(f"{name}: the optimizer updates the reference's parameters; the reference must stay "
                         "frozen (make the optimizer from the policy only)")  # fmt: skip


# -- the task ---------------------------------------------------------------------------------------------------------


class ReversalTask:
    """String reversal as text for a decoder-only model: prompt <bos> s "=", response reversed(s) <eos>.

    Strings of length min_len..max_len over the first n_symbols of `tfm_common.data.SYMBOLS`; `split(n_train,
    n_test, seed)` draws disjoint training and test strings (a test string is never seen in training)."""

    def __init__(self, n_symbols: int = 6, min_len: int = 4, max_len: int = 8):
        self.n_symbols = check_size("ReversalTask", "n_symbols", n_symbols)
        self.min_len = check_size("ReversalTask", "min_len", min_len)
        self.max_len = check_size("ReversalTask", "max_len", max_len, self.min_len)
        self.vocab = Vocab(list(SYMBOLS[: self.n_symbols]) + ["="])
        self.sep_id = self.vocab.stoi["="]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab.itos)

    @property
    def max_tokens(self) -> int:
        """The longest sequence: <bos> s = reversed(s) <eos>."""
        return 2 * self.max_len + 3

    def split(self, n_train: int, n_test: int, seed: int) -> tuple[list[str], list[str]]:
        train = reverse_task(n_train, self.min_len, self.max_len, self.n_symbols, seed)
        test = reverse_task(n_test, self.min_len, self.max_len, self.n_symbols, seed + 1, exclude=[s for s, _ in train])
        return [s for s, _ in train], [s for s, _ in test]

    def prompt(self, s: str) -> list[int]:
        return [BOS_ID, *self.vocab.encode(s, add_eos=False), self.sep_id]

    def answer(self, s: str) -> list[int]:
        """The right response: reversed(s) <eos>."""
        return self.vocab.encode(s[::-1])

    def response(self, generated: Sequence[int]) -> list[int]:
        """A generated continuation cut after its first <eos> (kept), or all of it if there is none."""
        out = [int(t) for t in generated]
        return out[: out.index(EOS_ID) + 1] if EOS_ID in out else out

    def is_correct(self, s: str, response: Sequence[int]) -> bool:
        return list(response) == self.answer(s)


def sft_batch(task: ReversalTask, strings: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Supervised windows: x (B, T) the sequences without their last token, y (B, T) the next tokens, PAD_ID (the
    loss's ignore_index) at the prompt's predictions and the padding: the model learns the responses only."""
    rows = [(task.prompt(s), task.answer(s)) for s in strings]
    return _as_batch(rows, lambda p, r: r)


def _as_batch(rows, targets_of) -> tuple[np.ndarray, np.ndarray]:
    T = max(len(p) + len(r) for p, r in rows) - 1
    x, y = np.full((len(rows), T), PAD_ID, np.int64), np.full((len(rows), T), PAD_ID, np.int64)
    for i, (p, r) in enumerate(rows):
        full = p + r
        x[i, : len(full) - 1] = full[:-1]
        y[i, len(p) - 1 : len(full) - 1] = targets_of(p, r)
    return x, y


def sample_answers(generate: Callable, task: ReversalTask, strings: Sequence[str], temperature: float,
                   rng: np.random.Generator) -> list[list[int]]:  # fmt: skip
    """One response per string from `generate(prompts (n, T0) int64, max_new_tokens, temperature, rng) -> (n, T0 +
    max_new_tokens)` (a model's `generate`, wrapped for its track), the prompts grouped by length (no padding in a
    prompt), max_len + 1 new tokens each (room for the longest answer and its <eos>), cut after <eos>."""
    out: list[list[int] | None] = [None] * len(strings)
    for length in sorted({len(s) for s in strings}):
        idx = [i for i, s in enumerate(strings) if len(s) == length]
        prompts = np.array([task.prompt(strings[i]) for i in idx], dtype=np.int64)
        gen = np.asarray(generate(prompts, length + 1, temperature, rng))[:, prompts.shape[1] :]
        for k, i in enumerate(idx):
            out[i] = task.response(gen[k])
    return out


def preference_pairs(task: ReversalTask, strings: Sequence[str], first: Sequence, second: Sequence):
    """From two answers per prompt, the pairs (s, chosen, rejected) where exactly one answer is right (chosen)."""
    pairs = []
    for s, a, b in zip(strings, first, second, strict=True):
        ra, rb = task.is_correct(s, a), task.is_correct(s, b)
        if ra != rb:
            pairs.append((s, list(a), list(b)) if ra else (s, list(b), list(a)))
    return pairs


def response_batch(task: ReversalTask, strings: Sequence[str], responses: Sequence) -> PreferenceBatch:
    """One response per prompt as rows (tokens, targets, mask), right-padded with PAD_ID; mask True at the response's
    targets. Right padding suits a causal model: a real token never attends to the padding after it."""
    if not len(strings):
        raise ValueError("response_batch: strings is empty; need at least one prompt and its response")
    rows = [(task.prompt(s), [int(t) for t in r]) for s, r in zip(strings, responses, strict=True)]
    x, y = _as_batch(rows, lambda p, r: r)
    mask = np.zeros(x.shape, dtype=bool)
    for i, (p, r) in enumerate(rows):
        mask[i, len(p) - 1 : len(p) - 1 + len(r)] = True
    return PreferenceBatch(x, y, mask)


def preference_batch(task: ReversalTask, pairs: Sequence[tuple[str, list[int], list[int]]]) -> PreferenceBatch:
    """B pairs (s, chosen, rejected) -> a `PreferenceBatch` of 2B rows: the chosen answers, then the rejected ones."""
    if not pairs:
        raise ValueError("preference_batch: pairs is empty; need at least one (string, chosen, rejected)")
    strings = [s for s, _, _ in pairs]
    return response_batch(task, strings + strings, [c for _, c, _ in pairs] + [r for _, _, r in pairs])
