"""The diagram of DPO's data flow (chapter 22d), drawn from one real pair: the prompt with its chosen and rejected
answers goes through the policy (trained) and through the frozen reference; each gives the log-probability of each
answer (`sequence_logps`: the response tokens only); the implicit rewards, their margin and the loss follow
(`dpo_loss`); the gradient flows back into the policy alone.

It takes what a run computed (the four log-probabilities and `dpo_loss`'s result for the pair) and only draws it.
Figures use matplotlib's object API, as `tfm_common.plotting`.
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

__all__ = ["plot_dpo_flow", "FLOW_COLORS"]

FLOW_COLORS = {  # face colors
    "data": "#e5e5e5",  # the pair: data, not a model
    "policy": "#c6dbef",  # the model being trained
    "reference": "#eeeeee",  # the frozen copy
    "logp": "#fff3b0",  # log-probabilities
    "reward": "#cdeccd",  # implicit rewards and the margin
    "loss": "#fdd9a6",  # the loss
}
GRAD = "#c0392b"  # the gradient's path, as in tfm_common.diagrams


def _box(ax, x, y, w, h, text, kind, gid=None, fontsize=8.5):
    patch = FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0,rounding_size=0.08")
    patch.set(facecolor=FLOW_COLORS[kind], edgecolor="#333333", linewidth=1.0)
    ax.add_patch(patch)
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize, gid=gid or kind)


def _arrow(ax, a, b, color="black", ls="-", rad=0.0):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=10, color=color, ls=ls, lw=1.1,
                                 connectionstyle=f"arc3,rad={rad}", shrinkA=2, shrinkB=2))  # fmt: skip


def plot_dpo_flow(prompt: str, chosen: str, rejected: str, logps: dict, result: dict, beta: float) -> Figure:
    """One pair through DPO. `logps`: {"policy_chosen", "policy_rejected", "ref_chosen", "ref_rejected"} (floats,
    from `sequence_logps`); `result`: {"chosen_reward", "rejected_reward", "margin", "loss"} for this pair (from
    `dpo_loss`); `beta` the one they were computed with."""
    need_logps = {"policy_chosen", "policy_rejected", "ref_chosen", "ref_rejected"}
    need_result = {"chosen_reward", "rejected_reward", "margin", "loss"}
    if set(logps) != need_logps:
        raise ValueError(f"plot_dpo_flow: logps expected the keys {sorted(need_logps)}, got {sorted(logps)}")
    if set(result) != need_result:
        raise ValueError(f"plot_dpo_flow: result expected the keys {sorted(need_result)}, got {sorted(result)}")
    fig = Figure(figsize=(10.0, 4.6))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 10.0)
    ax.set_ylim(0, 4.6)
    ax.set_axis_off()

    _box(ax, 1.15, 3.45, 2.0, 0.5, f"prompt  x = {prompt}", "data", "prompt")
    _box(ax, 1.15, 2.55, 2.0, 0.5, f"chosen  y_w = {chosen}\n(right)", "data", "chosen")
    _box(ax, 1.15, 1.65, 2.0, 0.5, f"rejected  y_l = {rejected}\n(wrong)", "data", "rejected")
    _box(ax, 3.7, 3.25, 1.9, 0.7, "policy  pi_theta\n(trained)", "policy")
    _box(ax, 3.7, 1.45, 1.9, 0.7, "reference  pi_ref\n(frozen copy of the SFT model,\nno_grad)", "reference",
         fontsize=7.5)  # fmt: skip
    for y in (3.45, 2.55, 1.65):
        _arrow(ax, (2.15, y), (2.75, 3.25))
        _arrow(ax, (2.15, y), (2.75, 1.45))
    ax.text(3.55, 2.35, "sequence_logps: sum of log p\nover the response tokens\n(prompt, padding masked)",
            ha="center", va="center", fontsize=7, color="#333333")  # fmt: skip

    rows = (("policy_chosen", 3.65, "log pi_theta(y_w|x)"), ("policy_rejected", 2.95, "log pi_theta(y_l|x)"),
            ("ref_chosen", 1.85, "log pi_ref(y_w|x)"), ("ref_rejected", 1.15, "log pi_ref(y_l|x)"))  # fmt: skip
    for key, y, name in rows:
        _box(ax, 5.9, y, 2.0, 0.45, f"{name}\n= {logps[key]:.3f}", "logp", key, fontsize=7.5)
        _arrow(ax, (4.65, 3.25 if key.startswith("policy") else 1.45), (4.9, y))

    _box(ax, 8.0, 3.3, 1.75, 0.6, f"r_w = beta (pi - ref)\n= {result['chosen_reward']:.3f}", "reward",
         "chosen_reward", fontsize=7.5)  # fmt: skip
    _box(ax, 8.0, 2.4, 1.75, 0.6, f"r_l = beta (pi - ref)\n= {result['rejected_reward']:.3f}", "reward",
         "rejected_reward", fontsize=7.5)  # fmt: skip
    for key, y in (("chosen", 3.3), ("rejected", 2.4)):
        _arrow(ax, (6.9, 3.65 if key == "chosen" else 2.95), (7.12, y))
        _arrow(ax, (6.9, 1.85 if key == "chosen" else 1.15), (7.12, y), ls="--")
    _box(ax, 8.0, 1.45, 1.75, 0.55, f"margin z = r_w - r_l\n= {result['margin']:.3f}", "reward", "margin",
         fontsize=7.5)  # fmt: skip
    _arrow(ax, (8.0, 2.1), (8.0, 1.73))
    _box(ax, 8.0, 0.55, 1.75, 0.55, f"loss = -log sigmoid(z)\n= {result['loss']:.3f}", "loss", "loss", fontsize=7.5)
    _arrow(ax, (8.0, 1.17), (8.0, 0.83))
    ax.text(8.0, 4.2, f"beta = {beta:g}", ha="center", va="center", fontsize=8.5, gid="beta")

    # the backward: into the policy only
    ax.plot([7.1, 4.78, 4.78], [0.55, 0.55, 2.55], color=GRAD, ls="--", lw=1.1)  # between the reference and the logps
    _arrow(ax, (4.78, 2.55), (4.4, 2.92), color=GRAD, ls="--")
    ax.text(5.0, 0.3, "gradient: -beta sigmoid(-z) (d log pi(y_w) - d log pi(y_l)), into the policy only",
            ha="center", va="center", fontsize=7.5, color=GRAD, gid="gradient")  # fmt: skip
    ax.text(3.7, 0.85, "no gradient: the reference stays where SFT left it", ha="center", va="center",
            fontsize=7, color="#555555", gid="frozen")  # fmt: skip
    return fig
