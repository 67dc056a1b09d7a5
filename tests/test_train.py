"""Training loops in both tracks: twin training (the same weights and batches give the same losses step by step),
learning a tiny task, the history, checkpoints, clipping, evaluation on decoded outputs, determinism, bad input."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch
from helpers_tracks import load_np_into_torch, max_abs_diff

import tfm_numpy as tn
import tfm_torch as tt
from tfm_common.data import SYMBOLS, Batch, Vocab, copy_task, encode_pairs, make_batches, reverse_task
from tfm_common.training import History, StepResult

VOCAB = Vocab(SYMBOLS[:8])
TINY = dict(d_model=16, n_heads=2, d_ff=32, n_layers=2, max_len=32)


def batches(n=96, batch_size=16, task=reverse_task, seed=0) -> list[Batch]:
    pairs = task(n, 2, 6, 8, rng=seed)
    return make_batches(encode_pairs(pairs, VOCAB, VOCAB), batch_size, rng=seed)


def np_model(dtype=np.float64, dropout=0.0, seed=0, **kw):
    return tn.Transformer(len(VOCAB), len(VOCAB), **{**TINY, **kw}, dropout=dropout, rng=seed, dtype=dtype)


def torch_twin(m: tn.Transformer, dtype=torch.float64, **kw) -> tt.Transformer:
    t = tt.Transformer(len(VOCAB), len(VOCAB), **{**TINY, **kw}, dropout=0.0, rng=1, dtype=dtype)
    load_np_into_torch(m, t)
    return t


def run(track, model, data, **kw):
    kw = {"steps": 20, "warmup": 10, "factor": 0.5, "progress": False, **kw}
    return track.train(model, data, track.make_adam(model), **kw)


# -- twin training ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("clip_norm", [None, 0.5], ids=["no-clip", "clip"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-ln", "pre-ln"])
def test_twin_training_float64_same_losses_step_by_step(clip_norm, norm_first):
    """The book's twin training: same initial weights, same batches, float64, dropout off: 20 steps agree."""
    data = batches()
    m_np = np_model(norm_first=norm_first)
    m_t = torch_twin(m_np, norm_first=norm_first)
    h_np = run(tn, m_np, data, clip_norm=clip_norm)
    h_t = run(tt, m_t, data, clip_norm=clip_norm)
    assert len(h_np) == len(h_t) == 20
    assert max(abs(a - b) for a, b in zip(h_np.loss, h_t.loss, strict=True)) < 1e-8
    assert max(abs(a - b) for a, b in zip(h_np.grad_norm, h_t.grad_norm, strict=True)) < 1e-8
    assert h_np.lr == h_t.lr and h_np.tokens == h_t.tokens and h_np.step == h_t.step == list(range(1, 21))
    sd_t = m_t.state_dict()
    diff = {k: max_abs_diff(v, sd_t[k]) for k, v in m_np.state_dict().items()}
    assert max(d for k, d in diff.items() if "k_proj.bias" not in k) < 1e-12  # measured ~1e-14
    # The key bias has a zero gradient in exact arithmetic (it adds q.b to every score of a row: softmax ignores
    # that); its computed gradient is rounding noise (~1e-18), different in each track, and Adam turns it into
    # steps of about lr * noise / eps (eps = 1e-9): the two tracks' k_proj.bias drift apart by ~1e-10.
    assert max(d for k, d in diff.items() if "k_proj.bias" in k) < 1e-8
    assert h_np.loss[-1] < h_np.loss[0]  # and it learned something
    if clip_norm is not None:
        assert max(h_np.grad_norm) > clip_norm  # the clipping was active


def test_train_step_twin_returns_loss_and_norm_before_clipping():
    data = batches()
    m_np = np_model()
    m_t = torch_twin(m_np)
    loss_np, loss_t = tn.CrossEntropyLoss(0, 0.1), tt.CrossEntropyLoss(0, 0.1)
    r_np = tn.train_step(m_np, data[0], tn.make_adam(m_np), loss_np, lr=1e-3, clip_norm=1e-3)
    r_t = tt.train_step(m_t, data[0], tt.make_adam(m_t), loss_t, lr=1e-3, clip_norm=1e-3)
    assert isinstance(r_np, StepResult) and isinstance(r_t, StepResult)
    assert isinstance(r_np.loss, float) and isinstance(r_t.grad_norm, float)
    assert abs(r_np.loss - r_t.loss) < 1e-12 and abs(r_np.grad_norm - r_t.grad_norm) < 1e-10
    assert r_np.grad_norm > 1e-3  # the norm before clipping ...
    assert tn.grad_norm(m_np) == pytest.approx(1e-3, rel=1e-5)  # ... and the gradients left after it
    assert tt.grad_norm(m_t) == pytest.approx(1e-3, rel=1e-5)
    assert r_np.loss == pytest.approx(float(loss_np(np_model()(data[0].src, data[0].tgt_in), data[0].tgt_out)))


def test_clip_norm_large_changes_nothing_small_changes_the_run():
    data = batches()
    h_free = run(tn, np_model(), data, steps=5)
    h_big = run(tn, np_model(), data, steps=5, clip_norm=1e6)
    h_small = run(tn, np_model(), data, steps=5, clip_norm=1e-4)
    assert h_free.loss == h_big.loss and h_free.grad_norm == h_big.grad_norm
    assert h_small.loss[0] == h_free.loss[0] and h_small.loss[1:] != h_free.loss[1:]


# -- learning ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("track", [tn, tt], ids=["numpy", "torch"])
def test_training_reduces_the_loss_on_a_copy_task(track):
    data = batches(n=128, task=copy_task)
    if track is tn:
        model = np_model(np.float32)
    else:
        model = tt.Transformer(len(VOCAB), len(VOCAB), **TINY, dropout=0.0, rng=0, dtype=torch.float32)
    h = track.train(model, data, track.make_adam(model), epochs=30, warmup=30, factor=0.5, progress=False)
    assert len(h) == 30 * len(data)
    first, last = np.mean(h.loss[: len(data)]), np.mean(h.loss[-len(data) :])  # the first and the last epoch
    assert last < 0.45 * first, (first, last)  # about 2.5 -> 0.8 (0.5 is the floor with label smoothing 0.1)
    assert all(math.isfinite(x) for x in h.loss + h.grad_norm)


@pytest.mark.parametrize("track", [tn, tt], ids=["numpy", "torch"])
def test_the_same_run_twice_gives_identical_histories(track):
    """Determinism: seeded model (dropout on, from the model's own generator), the same batches, the same losses."""

    def once():
        def data(epoch):  # a new shuffle each epoch, drawn from the epoch number
            return make_batches(encode_pairs(reverse_task(48, 2, 6, 8, rng=5), VOCAB, VOCAB), 16, rng=epoch)

        if track is tn:
            model = np_model(np.float32, dropout=0.1)
        else:
            model = tt.Transformer(len(VOCAB), len(VOCAB), **TINY, dropout=0.1, rng=0, dtype=torch.float32)
        return run(track, model, data, steps=8)

    a, b = once(), once()
    assert a.loss == b.loss and a.grad_norm == b.grad_norm


# -- the history and the stream of batches -----------------------------------------------------------------------------


@pytest.mark.parametrize("track", [tn, tt], ids=["numpy", "torch"])
def test_history_steps_epochs_and_resuming(track):
    data = batches(n=40, batch_size=16)  # 3 batches
    model = np_model() if track is tn else torch_twin(np_model())
    opt = track.make_adam(model)
    h = track.train(model, data, opt, steps=7, warmup=4, progress=False)
    assert len(h) == len(h.loss) == len(h.lr) == len(h.grad_norm) == len(h.tokens) == 7
    assert h.step == list(range(1, 8))
    assert h.tokens == [b.n_tokens for b in (data * 3)[:7]]
    assert h.lr == [tn.noam_lr(s, TINY["d_model"], 4) for s in range(1, 8)]
    h2 = track.train(model, data, opt, epochs=2, warmup=4, history=h, progress=False)
    assert h2 is h and len(h) == 7 + 6 and h.step == list(range(1, 14))  # the schedule goes on from step 8
    assert h.lr[7] == tn.noam_lr(8, TINY["d_model"], 4)
    assert h.seconds > 0 and "13 steps" in repr(h)
    assert History.from_dict(h.to_dict()) == h


def test_cooldown_scales_the_last_steps_of_the_schedule_down():
    h = run(tn, np_model(), batches(), steps=10, cooldown=4)
    noam = [tn.noam_lr(s, TINY["d_model"], 10, 0.5) for s in range(1, 11)]
    assert h.lr == pytest.approx([*noam[:6], noam[6] * 4 / 4, noam[7] * 3 / 4, noam[8] * 2 / 4, noam[9] / 4])
    h_t = run(tt, torch_twin(np_model()), batches(), steps=10, cooldown=4)
    assert h_t.lr == h.lr
    h_epochs = run(tn, np_model(), batches(), steps=None, epochs=2, cooldown=3)  # 6 batches: 12 steps known
    assert h_epochs.lr[-1] == pytest.approx(tn.noam_lr(12, TINY["d_model"], 10, 0.5) / 3)


def test_batches_from_a_callable_get_the_epoch_number():
    seen = []

    def make(epoch):
        seen.append(epoch)
        return batches(n=32, seed=epoch)  # 2 batches each

    h = run(tn, np_model(), make, steps=5)
    assert seen == [0, 1, 2] and len(h) == 5


@pytest.mark.parametrize("track", [tn, tt], ids=["numpy", "torch"])
def test_model_mode_restored_and_dropout_on_while_training(track):
    model = np_model(dropout=0.5) if track is tn else tt.Transformer(len(VOCAB), len(VOCAB), **TINY, dropout=0.5)
    model.eval()
    seen = []
    track.train(model, batches(), track.make_adam(model), steps=2, warmup=2, progress=False,
                eval_fn=lambda m: seen.append(m.training) or {})  # fmt: skip
    assert model.training is False and seen == [True]


def test_progress_bar_on_stderr_and_silent_without(capsys):
    run(tn, np_model(), batches(), steps=3, progress=True, log_every=1, desc="twin")
    out, err = capsys.readouterr()
    assert out == "" and "twin" in err and "3/3" in err and "loss=" in err
    run(tn, np_model(), batches(), steps=3, progress=False)
    assert capsys.readouterr() == ("", "")


# -- evaluation, checkpoints ----------------------------------------------------------------------------------------


def test_evaluate_decodes_greedily_in_both_tracks_alike():
    pairs = reverse_task(20, 2, 6, 8, rng=3)
    m_np = np_model()
    run(tn, m_np, batches(), steps=10)
    m_t = torch_twin(m_np)
    e_np = tn.evaluate(m_np, pairs, VOCAB, VOCAB, max_len=10)
    e_t = tt.evaluate(m_t, pairs, VOCAB, VOCAB, max_len=10)
    assert e_np.hypotheses == e_t.hypotheses and e_np.exact_match == e_t.exact_match and e_np.bleu == e_t.bleu
    assert e_np.sources == [s for s, _ in pairs] and e_np.references == [t for _, t in pairs]
    src = np.array([VOCAB.encode(pairs[0][0])])
    by_hand = VOCAB.decode(tn.greedy_decode(m_np, src, 1, 2, 10)[0])
    assert e_np.hypotheses[0] == by_hand
    assert len(e_np.errors()) == round(20 * (1 - e_np.exact_match))
    perfect = tn.evaluate(m_np, list(zip(e_np.sources, e_np.hypotheses, strict=True)), VOCAB, VOCAB, max_len=10)
    assert perfect.exact_match == 1.0 and perfect.metrics()["exact_match"] == 1.0


def test_evaluate_as_eval_fn_during_training():
    pairs = reverse_task(8, 2, 6, 8, rng=3)
    h = run(tn, np_model(), batches(), steps=5, eval_every=2,
            eval_fn=lambda m: tn.evaluate(m, pairs, VOCAB, VOCAB, max_len=8, bleu=False).metrics())  # fmt: skip
    assert [e["step"] for e in h.evals] == [2, 4, 5] and set(h.evals[0]) == {"step", "exact_match"}


def test_checkpoints_during_and_after_training_load_in_both_tracks(tmp_path):
    path = tmp_path / "ckpt.npz"
    model = np_model()
    opt = tn.make_adam(model)
    h = tn.train(model, batches(), opt, steps=7, warmup=4, checkpoint_path=path, checkpoint_every=3, progress=False)
    fresh = np_model(seed=9)
    opt2 = tn.make_adam(fresh)
    extra = tn.load_checkpoint(path, fresh, opt2)  # the last one: after step 7
    assert all(np.array_equal(v, fresh.state_dict()[k]) for k, v in model.state_dict().items())
    assert opt2.step_count == 7 and extra["epoch"] == 1
    assert History.from_dict(extra["history"]).loss == h.loss
    t = tt.Transformer(len(VOCAB), len(VOCAB), **TINY, dropout=0.0, rng=1, dtype=torch.float64)
    tt.load_checkpoint(path, t)
    assert max(max_abs_diff(v, t.state_dict()[k]) for k, v in model.state_dict().items()) == 0.0
    tpath = tmp_path / "ckpt.pt"
    ht = tt.train(t, batches(), tt.make_adam(t), steps=2, warmup=4, checkpoint_path=tpath, progress=False)
    assert History.from_dict(tt.load_checkpoint(tpath, t)["history"]).loss == ht.loss


def test_checkpoint_every_writes_mid_run(tmp_path, monkeypatch):
    calls = []
    track = importlib.import_module("tfm_numpy.train").TRACK  # the module's: `tfm_numpy.train` is the function
    monkeypatch.setattr(track, "save_checkpoint", lambda p, m, o, extra: calls.append(len(extra["history"]["loss"])))
    run(tn, np_model(), batches(), steps=7, checkpoint_path=tmp_path / "c.npz", checkpoint_every=3)
    assert calls == [3, 6, 7]


# -- bad input --------------------------------------------------------------------------------------------------------


def test_non_finite_loss_stops_with_the_step():
    model = np_model()
    model.encoder.layers[0].self_attn.q_proj.weight.data[...] = np.nan
    with pytest.raises(FloatingPointError, match="at step 1"):
        run(tn, model, batches())


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(steps=None), ValueError, "exactly one of steps and epochs"),
        (dict(steps=3, epochs=1), ValueError, "exactly one of steps and epochs"),
        (dict(steps=0), ValueError, "steps must be an int >= 1, got 0"),
        (dict(steps=2.5), TypeError, "steps expected an int"),
        (dict(log_every=0), ValueError, "log_every must be an int >= 1"),
        (dict(warmup=0), ValueError, "warmup must be an int >= 1"),
        (dict(factor=-1.0), ValueError, "factor must be a positive"),
        (dict(lr_schedule=0.1), TypeError, "lr_schedule expected a callable"),
        (dict(label_smoothing=0.1, loss_fn=tn.CrossEntropyLoss(0)), ValueError, "label_smoothing or loss_fn"),
        (dict(label_smoothing=1.5), ValueError, "label_smoothing"),
        (dict(checkpoint_every=2), ValueError, "checkpoint_every=2 needs a checkpoint_path"),
        (dict(eval_every=2), ValueError, "eval_every=2 needs an eval_fn"),
        (dict(eval_fn=3), TypeError, "eval_fn expected a callable"),
        (dict(history=[]), TypeError, "history expected a History"),
        (dict(cooldown=21), ValueError, "cooldown=21 is longer than the 20 steps"),
        (dict(cooldown=-1), ValueError, "cooldown must be an int >= 0"),
        (
            dict(steps=None, epochs=1, cooldown=2, batches=lambda e: batches()),
            ValueError,
            "cooldown=2 needs the number",
        ),
    ],
)
def test_bad_arguments_are_clear_errors_before_any_step(kwargs, error, match):
    model = np_model()
    before = model.state_dict()
    data = kwargs.pop("batches", batches())
    with pytest.raises(error, match=match):
        run(tn, model, data, **kwargs)
    assert all(np.array_equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("track", [tn, tt], ids=["numpy", "torch"])
def test_bad_models_optimizers_and_batches(track):
    model = np_model() if track is tn else torch_twin(np_model())
    opt = track.make_adam(model)
    with pytest.raises(TypeError, match="model expected"):
        track.train(object(), batches(), opt, steps=1, progress=False)
    with pytest.raises(TypeError, match="optimizer expected"):
        track.train(model, batches(), object(), steps=1, progress=False)
    with pytest.raises(ValueError, match="batches is empty"):
        track.train(model, [], opt, steps=1, progress=False)
    with pytest.raises(TypeError, match="expected a tfm_common.data.Batch, got tuple"):
        track.train(model, [(1, 2)], opt, steps=1, progress=False)
    with pytest.raises(ValueError, match="epoch 0 gave no batches"):
        track.train(model, lambda epoch: [], opt, steps=1, progress=False)
    with pytest.raises(TypeError, match="batches expected a list of Batch or a callable"):
        track.train(model, 5, opt, steps=1, progress=False)
    with pytest.raises(TypeError, match="train_step: batch expected"):
        track.train_step(model, "batch", opt, track.CrossEntropyLoss(0), 1e-3)
    with pytest.raises(ValueError, match="pairs is empty"):
        track.evaluate(model, [], VOCAB, VOCAB)


# -- the plumbing shared by the tracks ----------------------------------------------------------------------------


@pytest.mark.parametrize("track", [tn, tt], ids=["numpy", "torch"])
def test_train_and_evaluate_give_every_submodule_its_own_mode_back(track):
    """A frozen part (here the encoder, in eval mode inside a model in training mode) stays frozen after an
    evaluation and after training: each submodule gets its own mode back, not the model's."""
    model = np_model(dropout=0.1)
    model = model if track is tn else torch_twin(model)
    model.train()
    model.encoder.eval()
    modes = [(m, m.training) for _, m in model.named_modules()]
    track.evaluate(model, reverse_task(4, 2, 4, 8, rng=1), VOCAB, VOCAB, max_len=8, bleu=False)
    assert [m.training for m, _ in modes] == [was for _, was in modes]
    run(track, model, batches(), steps=1)
    assert [m.training for m, _ in modes] == [was for _, was in modes]


@pytest.mark.parametrize("track", [tn, tt], ids=["numpy", "torch"])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy warns of the inf and nan on the way
def test_a_non_finite_step_is_refused_in_the_name_of_its_step_function(track):
    model = np_model()
    model = model if track is tn else torch_twin(model)
    with torch.no_grad():
        weight = model.output_projection.weight
        (weight.data if track is tn else weight)[3, 0] = np.inf  # an infinite logit weight: the loss is nan
    data, loss_fn = batches(), track.CrossEntropyLoss(0)
    with pytest.raises(FloatingPointError, match="^train_step_accumulated: the loss is nan"):
        track.train_step_accumulated(model, data[:2], track.make_adam(model), loss_fn, 1e-3)
    with pytest.raises(FloatingPointError, match="^train_step: the loss is nan"):
        track.train_step(model, data[0], track.make_adam(model), loss_fn, 1e-3)


def test_the_schedules_are_one_object_for_both_tracks():
    assert tn.noam_lr is tt.noam_lr and tn.LossScaler is tt.LossScaler
    assert tt.Linear(3, 2).num_parameters() == tn.Linear(3, 2).num_parameters() == 8  # every torch module counts
