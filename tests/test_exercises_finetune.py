"""Wrong attempts at the exercises of chapter 22b (pooling the last non-pad token, forward and backward): each fails
with a message that points at the mistake; the chapter's own solution passes."""

from __future__ import annotations

import numpy as np
from helpers_exercises import fails, solution

from tfm_numpy.exercises import check


def _last(tokens, pad_id):
    return np.where(tokens != pad_id, np.arange(tokens.shape[1]), -1).max(axis=1)


# --- pool_last_forward ------------------------------------------------------------------------------------------------


def test_the_chapters_solutions_pass():
    assert check("pool_last_forward", solution("pool_last_forward"), quiet=True).passed
    assert check("pool_last_backward", solution("pool_last_backward"), quiet=True).passed


def test_reading_the_arrays_last_column_reads_padding():
    def attempt(h, tokens, pad_id):
        return h[:, -1]

    result = fails("pool_last_forward", attempt, "rows of 6, 3 and 1 tokens, padded to T = 6: off by", "not at the")
    assert not result.failed("no padding: every row full")  # right by chance where nothing is padded


def test_the_count_of_tokens_is_one_past_the_last():
    def attempt(h, tokens, pad_id):
        n = (tokens != pad_id).sum(axis=1)
        return h[np.arange(len(h)), np.minimum(n, tokens.shape[1] - 1)]  # off by one (clipped to stay in bounds)

    fails("pool_last_forward", attempt, "rows of 6, 3 and 1 tokens, padded to T = 6: off by")


def test_pad_zero_hard_coded():
    def attempt(h, tokens, pad_id):
        last = np.where(tokens != 0, np.arange(tokens.shape[1]), -1).max(axis=1)
        if (last < 0).any():
            raise ValueError("a row is all padding")
        return h[np.arange(len(h)), last]

    result = fails("pool_last_forward", attempt, "pad_id = 1 (not 0)")
    assert len(result.failures) == 1


def test_the_first_token_is_not_the_last():
    def attempt(h, tokens, pad_id):
        return h[:, 0]

    fails("pool_last_forward", attempt, "rows of 6, 3 and 1 tokens", "last token that is not pad_id")


def test_an_all_padding_row_read_silently():
    def attempt(h, tokens, pad_id):
        return h[np.arange(len(h)), _last(tokens, pad_id)]  # -1 for a row of padding: reads T - 1

    result = fails("pool_last_forward", attempt, "a row that is all padding: accepted it silently")
    assert len(result.failures) == 1


# --- pool_last_backward ---------------------------------------------------------------------------------------------


def test_the_gradient_spread_over_every_position():
    def attempt(d_pooled, h, tokens, pad_id):
        return np.repeat(d_pooled[:, None], h.shape[1], axis=1)

    result = fails("pool_last_backward", attempt, "rows of 6, 3 and 1 tokens, padded to T = 6: dh: off by")
    assert result.failed("dh is zero everywhere except at (b, t_b)")
    assert not result.failed("T = 1")  # one position: there is nowhere else to put it


def test_the_gradient_at_the_last_column():
    def attempt(d_pooled, h, tokens, pad_id):
        dh = np.zeros_like(h)
        dh[:, -1] = d_pooled
        return dh

    fails("pool_last_backward", attempt, "rows of 6, 3 and 1 tokens, padded to T = 6: dh: off by")


def test_the_gradient_of_the_pooled_shape():
    def attempt(d_pooled, h, tokens, pad_id):
        return d_pooled  # (B, d): not scattered back into (B, T, d)

    fails("pool_last_backward", attempt, "shape (3, 5), expected (3, 6, 5)")


def test_the_gradient_in_float64_for_float32_inputs():
    def attempt(d_pooled, h, tokens, pad_id):
        dh = np.zeros(h.shape)  # float64 whatever h is
        dh[np.arange(len(h)), _last(tokens, pad_id)] = d_pooled
        return dh

    result = fails("pool_last_backward", attempt, "float32: dh: dtype float64, expected float32")
    assert len(result.failures) == 1
