"""Wrong attempts at the exercise of chapter 22a (BERT's 80/10/10 rule, `mask_rule`): each fails with a message that
points at the mistake."""

from __future__ import annotations

import numpy as np
from helpers_exercises import fails

from tfm_numpy.exercises import check


def _rule(ids, u_choose, u_fate, random_ids, mask_id, special_ids, p, *, skip_specials=True, strict=True,
          random=True, ignore=True, keep_unchosen=True):  # fmt: skip
    """The rule with one of its parts switchable off: each switch is a mistake people make."""
    chosen = (u_choose < p) if strict else (u_choose <= p)
    if skip_specials:
        chosen = chosen & ~np.isin(ids, special_ids)
    masked = u_fate < 0.8
    inputs = np.where((chosen if keep_unchosen else True) & masked, mask_id, ids)
    if random:
        inputs = np.where(chosen & (u_fate >= 0.8) & (u_fate < 0.9), random_ids, inputs)
    targets = np.where(chosen, ids, -100) if ignore else ids.copy()
    return inputs, targets


def test_reference_attempt_passes():
    assert check("mask_rule", _rule, quiet=True).passed


def test_choosing_special_tokens():
    def attempt(*args):
        return _rule(*args, skip_specials=False)

    fails("mask_rule", attempt, "special tokens with u_choose = 0: inputs", "never chosen")


def test_u_choose_equal_to_p_chosen():
    def attempt(*args):
        return _rule(*args, strict=False)

    result = fails("mask_rule", attempt, "the boundaries", "u_choose = p is NOT chosen")
    assert not result.failed("a batch (B, T)")  # random uniforms never hit p exactly: only the boundary shows it


def test_no_random_replacement_80_20():
    def attempt(*args):
        return _rule(*args, random=False)

    fails("mask_rule", attempt, "a batch (B, T) = (4, 25), p = 0.5: inputs", "random_ids where 0.8 <= u_fate < 0.9")


def test_targets_everywhere():
    def attempt(*args):
        return _rule(*args, ignore=False)

    result = fails("mask_rule", attempt, "targets: off by", "IGNORE_INDEX = -100 everywhere")
    assert not result.failed(": inputs")  # the inputs are right


def test_masking_positions_that_were_not_chosen():
    def attempt(*args):
        return _rule(*args, keep_unchosen=False)

    fails("mask_rule", attempt, "a batch (B, T) = (4, 25), p = 0.5: inputs", "chosen only where u_choose < p")


def test_returning_the_masked_batch_in_the_wrong_order():
    def attempt(*args):
        inputs, targets = _rule(*args)
        return targets, inputs

    fails("mask_rule", attempt, "inputs: off by")
