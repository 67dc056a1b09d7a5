"""The DPO data-flow diagram draws the numbers it is given, and those are the library's: the log-probabilities from
`sequence_logps` of a real pair, the rewards, margin and loss from `dpo_loss`; the gradient goes to the policy
only."""

import numpy as np
import pytest

import tfm_numpy as tn
from tfm_common.diagrams_dpo import FLOW_COLORS, plot_dpo_flow
from tfm_common.preference import ReversalTask, preference_batch


def _texts(ax, gid=None):
    return [t.get_text() for t in ax.texts if gid is None or t.get_gid() == gid]


def _real_pair():
    task = ReversalTask(n_symbols=4, min_len=2, max_len=4)
    cfg = dict(vocab_size=task.vocab_size, d_model=8, n_heads=2, d_ff=16, n_layers=1, max_len=task.max_tokens)
    policy, ref = tn.GPT(**cfg, rng=0, dtype=np.float64), tn.GPT(**cfg, rng=1, dtype=np.float64)
    batch = preference_batch(task, [("abc", task.answer("abc"), task.answer("abd"))])
    lp = tn.sequence_logps(policy(batch.tokens), batch.targets, batch.mask)
    lr = tn.sequence_logps(ref(batch.tokens), batch.targets, batch.mask)
    out = tn.dpo_loss(lp[:1], lp[1:], lr[:1], lr[1:], 0.5)
    logps = dict(policy_chosen=lp[0], policy_rejected=lp[1], ref_chosen=lr[0], ref_rejected=lr[1])
    result = dict(chosen_reward=out.chosen_rewards[0], rejected_reward=out.rejected_rewards[0],
                  margin=out.margins[0], loss=float(out.loss))  # fmt: skip
    return logps, result


def test_the_diagram_draws_the_library_numbers():
    logps, result = _real_pair()
    (ax,) = plot_dpo_flow("abc=", "cba", "dba", logps, result, beta=0.5).axes
    for key, value in logps.items():
        (text,) = _texts(ax, key)
        assert text.endswith(f"= {value:.3f}")
    for key, value in result.items():
        (text,) = _texts(ax, key)
        assert text.endswith(f"= {value:.3f}")
    assert float(_texts(ax, "margin")[0].split("= ")[-1]) == pytest.approx(
        result["chosen_reward"] - result["rejected_reward"], abs=2e-3
    )
    assert _texts(ax, "prompt") == ["prompt  x = abc="] and "cba" in _texts(ax, "chosen")[0]
    assert _texts(ax, "beta") == ["beta = 0.5"]
    assert "into the policy only" in _texts(ax, "gradient")[0] and _texts(ax, "frozen")
    assert any("frozen copy" in t for t in _texts(ax, "reference"))
    faces = {p.get_facecolor()[:3] for p in ax.patches if hasattr(p, "get_boxstyle")}
    assert len(faces) == len(FLOW_COLORS)


def test_refusals():
    logps, result = _real_pair()
    with pytest.raises(ValueError, match="logps expected the keys"):
        plot_dpo_flow("x", "y", "z", {"policy_chosen": 0.0}, result, 0.5)
    with pytest.raises(ValueError, match="result expected the keys"):
        plot_dpo_flow("x", "y", "z", logps, {"loss": 0.0}, 0.5)
