"""Unit tests of what every run leans on: the EMA, the Euler/CFG sampler, the noise-level draw and the
validation loss, each against values worked out by hand on stand-in models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from maskbench.eval.evaluate import EvalSet, validation_loss
from maskbench.eval.sample import euler_sample, fixed_noise, guided_velocity
from maskbench.models.objective import sample_t
from maskbench.train.ema import EMA

CPU = torch.device("cpu")


def _moved(model: nn.Module, seed: int) -> nn.Module:
    """The model with every weight set to fresh random values: a training step, as far as the EMA can tell."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    return model


# ------------------------------------------------------------------------------------------------------ EMA
def test_ema_decay_warms_up_as_1_plus_n_over_10_plus_n_then_holds_the_decay() -> None:
    model = nn.Linear(3, 2)
    ema = EMA(model, decay=0.9)
    decays = []
    for _ in range(100):
        decays.append(ema.current_decay())
        ema.update(model)
    assert decays[:3] == pytest.approx([1 / 10, 2 / 11, 3 / 12])
    assert decays[79] == pytest.approx(80 / 89) and decays[79] < 0.9   # (1 + n)/(10 + n) = 0.9 at n = 80
    assert decays[80:] == pytest.approx([0.9] * 20)


def test_ema_update_moves_each_weight_by_one_minus_the_decay_toward_the_model() -> None:
    model = _moved(nn.Linear(3, 2), seed=0)
    ema = EMA(model, decay=0.999)
    for step, decay in enumerate([1 / 10, 2 / 11]):                    # the warm-up decays of updates 0 and 1
        before = [p.clone() for p in ema.model.parameters()]
        _moved(model, seed=step + 1)
        ema.update(model)
        for averaged, old, new in zip(ema.model.parameters(), before, model.parameters()):
            torch.testing.assert_close(averaged, decay * old + (1 - decay) * new)
            assert not torch.equal(averaged, new)                          # a copy, not the model's own weights


def test_ema_state_dict_round_trip_restores_decay_updates_and_weights() -> None:
    model = nn.Linear(3, 2)
    ema = EMA(model, decay=0.95)
    for seed in range(3):
        ema.update(_moved(model, seed))
    restored = EMA(nn.Linear(3, 2), decay=0.5)
    restored.load_state_dict(ema.state_dict())
    assert (restored.decay, restored.updates) == (0.95, 3)
    for a, b in zip(restored.model.parameters(), ema.model.parameters()):
        assert torch.equal(a, b)
    _moved(model, seed=3)
    ema.update(model)
    restored.update(model)                                                 # resumes at the same warm-up decay
    for a, b in zip(restored.model.parameters(), ema.model.parameters()):
        assert torch.equal(a, b)


# -------------------------------------------------------------------------------------------------- sampler
class KnownVelocity(nn.Module):
    """A stand-in for the DiT with velocities given as functions of (x, t): `cond`, or `uncond` where the
    caption is dropped. Its 'tokens' are the flattened images; it records (batch, drop_context) per forward."""

    def __init__(self, cond, uncond, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.cond, self.uncond, self.shape = cond, uncond, shape
        self.forwards: list[tuple[int, list[bool] | None]] = []

    def forward(self, x, t, context, context_mask, drop_context=None, inputs=None) -> torch.Tensor:
        self.forwards.append((len(x), None if drop_context is None else drop_context.tolist()))
        t = t.view(-1, 1, 1, 1)
        v = self.cond(x, t)
        if drop_context is not None:
            v = torch.where(drop_context.view(-1, 1, 1, 1), self.uncond(x, t), v)
        return v.flatten(1)                                                 # B×(C·H·W)

    def unpatchify(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens.view(len(tokens), *self.shape)


SHAPE = (3, 4, 4)
CONTEXT, CONTEXT_MASK = torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.bool)


def test_guided_velocity_is_v_uncond_plus_s_times_v_cond_minus_v_uncond_and_scale_1_runs_one_forward() -> None:
    x, t = torch.randn(2, *SHAPE, generator=torch.Generator().manual_seed(0)), torch.tensor([0.3, 0.8])
    model = KnownVelocity(cond=lambda x, t: x + t, uncond=lambda x, t: -2 * x, shape=SHAPE)
    v_cond, v_uncond = x + t.view(-1, 1, 1, 1), -2 * x
    torch.testing.assert_close(guided_velocity(model, x, t, CONTEXT, CONTEXT_MASK, 2.5),
                               v_uncond + 2.5 * (v_cond - v_uncond))
    assert model.forwards == [(4, [False, False, True, True])]            # both halves in one doubled batch
    model.forwards.clear()
    torch.testing.assert_close(guided_velocity(model, x, t, CONTEXT, CONTEXT_MASK, 1.0), v_cond)
    assert model.forwards == [(2, None)]


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
@pytest.mark.parametrize("velocity, solution", [
    # v = x: every step multiplies x by 1 - s/N
    (lambda x, t, a: x, lambda noise, a, s, n: noise * (1 - s / n) ** n),
    # v = t·a read at t_k = 1 - k/N: the steps subtract s·a/N·sum_k t_k, and sum_k t_k = (N + 1)/2
    (lambda x, t, a: t * a, lambda noise, a, s, n: noise - s * a * (n + 1) / (2 * n)),
], ids=["v=x", "v=t*a"])
def test_euler_sample_takes_n_uniform_steps_from_t1_to_t0_reading_v_at_each_steps_start(
        velocity, solution, cfg_scale: float) -> None:
    gen = torch.Generator().manual_seed(0)
    noise, a = torch.randn(2, *SHAPE, generator=gen), torch.randn(SHAPE, generator=gen)
    model = KnownVelocity(cond=lambda x, t: velocity(x, t, a), uncond=lambda x, t: torch.zeros_like(x), shape=SHAPE)
    steps = 4
    out = euler_sample(model, noise, CONTEXT, CONTEXT_MASK, steps, cfg_scale)   # guided v = s·v_cond (v_uncond 0)
    torch.testing.assert_close(out, solution(noise, a, cfg_scale, steps))
    assert len(model.forwards) == steps


def test_fixed_noise_row_depends_only_on_the_seed_and_its_index() -> None:
    rows = fixed_noise([5, 2, 9], SHAPE, noise_seed=7)
    torch.manual_seed(123)                                                 # the global generator plays no part
    assert torch.equal(fixed_noise([2, 9], SHAPE, 7), rows[1:])
    assert torch.equal(fixed_noise([9, 2, 5], SHAPE, 7), rows.flip(0))
    assert not torch.equal(fixed_noise([5], SHAPE, 8)[0], rows[0])
    assert not torch.equal(rows[0], rows[1])


# ---------------------------------------------------------------------------------------------- noise levels
def test_sample_t_is_logit_normal_0_1_inside_the_open_unit_interval_and_seeded() -> None:
    n = 100_000
    t = sample_t(n, torch.Generator().manual_seed(0), CPU)
    assert t.shape == (n,) and bool(((t > 0) & (t < 1)).all())
    logit = torch.logit(t.double())
    # Standard errors at n = 1e5: 1/sqrt(n) = 0.0032 for the mean, about 1/sqrt(2n) = 0.0022 for the std;
    # the bounds are 5 of them (the draw is seeded, so the check is deterministic, not flaky).
    assert abs(logit.mean().item()) < 0.016 and abs(logit.std().item() - 1) < 0.011
    assert torch.equal(sample_t(n, torch.Generator().manual_seed(0), CPU), t)
    assert not torch.equal(sample_t(n, torch.Generator().manual_seed(1), CPU), t)


# ------------------------------------------------------------------------------------------- validation loss
class KnowsTheData(nn.Module):
    """A stand-in for the DiT on held-out sample i (told by its text embedding, i): it predicts the true
    velocity (x_t - x0_i)/t plus t·err_i in every value, so its squared error is t²·err_i² whatever the noise.
    It records which samples it read."""

    text_encoder = None                                                    # context = the precomputed txtemb

    def __init__(self, images: torch.Tensor, err: torch.Tensor) -> None:
        super().__init__()
        self.images, self.err, self.read = images, err, []

    def forward(self, x_t, t, context, context_mask, drop_context=None, inputs=None) -> torch.Tensor:
        i = context[:, 0, 0].long()                                        # B
        self.read.extend(i.tolist())
        t = t.view(-1, 1, 1, 1)
        return self.patchify((x_t - self.images[i]) / t + t * self.err[i].view(-1, 1, 1, 1))

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)                                                # B×(C·H·W): the loss averages all


def test_validation_loss_is_the_mean_over_t_of_the_mse_over_the_first_n_samples() -> None:
    images = torch.randn(6, *SHAPE, generator=torch.Generator().manual_seed(0))
    text = {"txtemb": torch.arange(6.0).view(6, 1, 1), "txtmask": torch.ones(6, 1, dtype=torch.bool)}
    evalset = EvalSet(images, [f"caption {i}" for i in range(6)], [{}] * 6, text)
    err = torch.arange(1.0, 7.0)                                           # distinct, so the samples' weights show
    model = KnowsTheData(images, err)
    t_values = [0.25, 0.5, 0.75]
    loss, per_t = validation_loss(model, evalset, t_values, noise_seed=3, batch_size=3, device=CPU, n=4)
    expected = [t * t * err[:4].square().mean().item() for t in t_values]  # t²·mean(err_i²) over i < 4
    # float32 rounding of (x_t - x0)/t is ~1e-7 of |x| ~ 3, against errors t·err_i >= 0.25: far inside 1e-5
    assert per_t == pytest.approx(expected, rel=1e-5)
    assert loss == pytest.approx(sum(expected) / len(t_values), rel=1e-5)
    assert model.read == [0, 1, 2, 3] * len(t_values)                     # batches of 3 cut at n = 4
