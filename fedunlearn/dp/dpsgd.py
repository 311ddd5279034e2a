"""DP-SGD for one client's local training, through Opacus (stage A of docs/algorithms.md,
"DP2Unlearning").

Symbols as in the DP2Unlearning / DP-SGD papers:

* (ε, δ): the privacy target of the WHOLE planned training of one client (all rounds together);
* C: the per-example clipping bound (``max_grad_norm``);
* q: the Poisson sampling rate (every record joins a step's batch with probability q, the
  expected batch is L = q·N for N local records);
* σ: the noise multiplier (Gaussian noise of standard deviation σ·C on the sum of clipped
  per-example gradients); calibrated from ε with Opacus's RDP accountant unless given.

Each step computes ``g = (Σ_i clip_C(∇ℓ_i) + 𝒩(0, σ²C²·I)) / (q·N)`` over the Poisson batch
and applies plain SGD ``θ ← θ − lr·g``. Clipping, noise and accounting are Opacus's
(``PrivacyEngine.make_private``, hooks grad-sample mode, ``DPOptimizer``, ``RDPAccountant``);
this module only wires them to a Hugging Face causal LM and keeps the accountant alive across
federated rounds. The unit of privacy is one training example (one tokenised record); an author
with k records is protected only through group privacy, (kε, k·e^((k−1)ε)·δ).

The Flower client is a fresh process each round, so the accountant travels as an
:class:`AccountantState` (its history as JSON) and the ε spent so far is always computed by
an Opacus ``RDPAccountant`` restored from that history.
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from fedunlearn.training.batching import Example, collate, token_nll

# Opacus is imported where it is used: every client process imports this module (its
# accountant state travels with every client's reply), and few of them run DP-SGD.
if TYPE_CHECKING:
    from opacus.accountants import RDPAccountant
    from opacus.data_loader import DPDataLoader

HistoryEntry = tuple[float, float, int]  # (σ, q, number of steps), as in RDPAccountant.history


def _positive_finite(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def _check_sample_rate(value: float) -> None:
    if not (isinstance(value, int | float) and 0 < value <= 1):
        raise ValueError(f"sample_rate q must lie in (0, 1], got {value!r}")


def _check_delta(value: float) -> None:
    if not (isinstance(value, int | float) and 0 < value < 1):
        raise ValueError(f"delta must lie in (0, 1), got {value!r}")


@functools.lru_cache(maxsize=64)
def _cached_noise_multiplier(
    epsilon: float, delta: float, sample_rate: float, total_steps: int, tolerance: float
) -> float:
    from opacus.accountants.utils import get_noise_multiplier

    return float(
        get_noise_multiplier(
            target_epsilon=epsilon,
            target_delta=delta,
            sample_rate=sample_rate,
            steps=total_steps,
            accountant="rdp",
            epsilon_tolerance=tolerance,
        )
    )


def calibrate_noise_multiplier(
    *,
    epsilon: float,
    delta: float,
    sample_rate: float,
    total_steps: int,
    epsilon_tolerance: float = 0.01,
) -> float:
    """The σ for which ``total_steps`` steps at sampling rate q cost at most (ε, δ) under RDP.

    Opacus's binary search (``get_noise_multiplier(..., accountant="rdp")``): the returned σ
    gives ε' ≤ ε with ε − ε' ≤ ``epsilon_tolerance`` (absolute). Results are cached.
    """
    _positive_finite("epsilon", epsilon)
    _check_delta(delta)
    _check_sample_rate(sample_rate)
    if not (isinstance(total_steps, int) and total_steps >= 1):
        raise ValueError(f"total_steps must be an int >= 1, got {total_steps!r}")
    _positive_finite("epsilon_tolerance", epsilon_tolerance)
    with warnings.catch_warnings():  # "optimal order is the largest alpha" for extreme ε
        warnings.simplefilter("ignore", UserWarning)
        return _cached_noise_multiplier(
            float(epsilon), float(delta), float(sample_rate), total_steps, float(epsilon_tolerance)
        )


@dataclass(frozen=True, kw_only=True)
class DpSgdSettings:
    """DP-SGD settings of one client.

    ``epsilon`` (ε) and ``delta`` (δ) are the target for the whole planned training of this
    client: ``total_rounds`` rounds of ``steps_per_round`` steps each. With
    ``noise_multiplier`` (σ) left at None, σ is calibrated so that all planned steps together
    cost at most (ε, δ); with σ given, ε is only the nominal target (it may then be ``inf``)
    and σ = 0 switches the noise off (no privacy; for tests). ``sample_rate`` is q (expected
    batch q·N), ``max_grad_norm`` is C, ``lr`` the SGD learning rate, ``seed`` seeds Poisson
    sampling and noise (per round, see :func:`train_dp_sgd`).
    """

    epsilon: float
    delta: float
    max_grad_norm: float = 1.0
    noise_multiplier: float | None = None
    sample_rate: float
    steps_per_round: int
    total_rounds: int
    lr: float
    seed: int = 0

    def __post_init__(self) -> None:
        if self.noise_multiplier is None:
            _positive_finite("epsilon (needed to calibrate the noise multiplier)", self.epsilon)
        elif not (isinstance(self.epsilon, int | float) and self.epsilon > 0):
            raise ValueError(f"epsilon must be > 0 (inf allowed), got {self.epsilon!r}")
        _check_delta(self.delta)
        _positive_finite("max_grad_norm C", self.max_grad_norm)
        if self.noise_multiplier is not None and not (
            isinstance(self.noise_multiplier, int | float)
            and math.isfinite(self.noise_multiplier)
            and self.noise_multiplier >= 0
        ):
            raise ValueError(
                f"noise_multiplier σ must be None or a finite number >= 0, "
                f"got {self.noise_multiplier!r}"
            )
        _check_sample_rate(self.sample_rate)
        for name in ("steps_per_round", "total_rounds"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        _positive_finite("lr", self.lr)
        if not (isinstance(self.seed, int) and not isinstance(self.seed, bool) and self.seed >= 0):
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")

    @property
    def total_steps(self) -> int:
        """All planned DP-SGD steps of this client: ``steps_per_round · total_rounds``."""
        return self.steps_per_round * self.total_rounds

    def resolved_noise_multiplier(self) -> float:
        """σ: the given one, or the one calibrated from (ε, δ, q, total planned steps)."""
        if self.noise_multiplier is not None:
            return float(self.noise_multiplier)
        return calibrate_noise_multiplier(
            epsilon=self.epsilon,
            delta=self.delta,
            sample_rate=self.sample_rate,
            total_steps=self.total_steps,
        )


@dataclass(frozen=True)
class AccountantState:
    """The persistent state of one client's RDP accountant: Opacus ``RDPAccountant.history``.

    ``history`` holds (σ, q, number of steps) entries in Opacus's own format (consecutive steps
    with the same σ and q are merged into one entry, as ``RDPAccountant.step`` does). The state
    is immutable; :func:`train_dp_sgd` returns a new one. It round-trips exactly through
    :meth:`to_json` / :meth:`from_json` (floats are written with full precision), so a client
    that lives one process per round can keep it in its message or on disk.
    """

    history: tuple[HistoryEntry, ...] = ()

    def __post_init__(self) -> None:
        cleaned = tuple(_check_entry(entry) for entry in self.history)
        object.__setattr__(self, "history", cleaned)

    @property
    def total_steps(self) -> int:
        """Number of DP-SGD steps recorded so far."""
        return sum(steps for _, _, steps in self.history)

    def to_accountant(self) -> RDPAccountant:
        """A fresh Opacus ``RDPAccountant`` holding a copy of this history."""
        from opacus.accountants import RDPAccountant

        accountant = RDPAccountant()
        accountant.history = list(self.history)
        return accountant

    @classmethod
    def from_accountant(cls, accountant: RDPAccountant) -> AccountantState:
        """Snapshot of an Opacus ``RDPAccountant``."""
        if accountant.mechanism() != "rdp":
            raise ValueError(f"need an RDP accountant, got mechanism {accountant.mechanism()!r}")
        return cls(tuple(tuple(entry) for entry in accountant.history))

    def record(self, *, noise_multiplier: float, sample_rate: float, steps: int) -> AccountantState:
        """A new state with ``steps`` more steps at (σ, q), recorded by ``RDPAccountant.step``."""
        if not (isinstance(steps, int) and steps >= 0):
            raise ValueError(f"steps must be an int >= 0, got {steps!r}")
        accountant = self.to_accountant()
        for _ in range(steps):
            accountant.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
        return AccountantState.from_accountant(accountant)

    def epsilon(self, delta: float) -> float:
        """ε spent so far at δ, as Opacus's ``RDPAccountant.get_epsilon`` computes it (0 when
        nothing was recorded, ``inf`` after any noise-free step)."""
        _check_delta(delta)
        if not self.history:
            return 0.0
        with warnings.catch_warnings():  # "optimal order is the largest/smallest alpha"
            warnings.simplefilter("ignore", UserWarning)
            return float(self.to_accountant().get_epsilon(delta=delta))

    def to_json(self) -> str:
        """``{"mechanism": "rdp", "history": [[σ, q, steps], ...]}``."""
        return json.dumps({"mechanism": "rdp", "history": [[s, q, n] for s, q, n in self.history]})

    @classmethod
    def from_json(cls, text: str) -> AccountantState:
        """Inverse of :meth:`to_json`; refuses anything that is not an RDP history."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"accountant state is not valid JSON: {err}") from err
        if not isinstance(data, dict) or data.get("mechanism") != "rdp":
            raise ValueError('accountant state must be a JSON object with "mechanism": "rdp"')
        history = data.get("history")
        if not isinstance(history, list):
            raise ValueError('accountant state needs a "history" list')
        entries = []
        for entry in history:
            if not (isinstance(entry, list) and len(entry) == 3):
                raise ValueError(f"history entries must be [sigma, q, steps], got {entry!r}")
            entries.append(tuple(entry))
        return cls(tuple(entries))


def _check_entry(entry: Sequence[float]) -> HistoryEntry:
    if len(entry) != 3:
        raise ValueError(f"history entries must be (sigma, q, steps), got {entry!r}")
    sigma, q, steps = entry
    if isinstance(sigma, bool) or not (
        isinstance(sigma, int | float) and math.isfinite(sigma) and sigma >= 0
    ):
        raise ValueError(f"history entry has an invalid noise multiplier: {entry!r}")
    if isinstance(q, bool) or not (isinstance(q, int | float) and 0 < q <= 1):
        raise ValueError(f"history entry has an invalid sample rate: {entry!r}")
    if isinstance(steps, bool) or not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"history entry has an invalid step count: {entry!r}")
    return (float(sigma), float(q), int(steps))


class _IndexDataset(Dataset):
    """Item i is ``(tensor(i),)``: Opacus's DPDataLoader wants tuples of tensors (it derives
    the shape of an empty batch from ``dataset[0]``); the examples are padded per batch."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor]:
        return (torch.tensor(index, dtype=torch.long),)


def _collate_indices(items: list[tuple[torch.Tensor]]) -> list[torch.Tensor]:
    return [torch.stack([item[0] for item in items])]


def _batch_indices(batch: object) -> list[int]:
    """Indices of a Poisson batch; Opacus hands an empty batch as ``[tensor([])]``."""
    if isinstance(batch, list | tuple):
        if not batch:
            return []
        batch = batch[0]
    if not isinstance(batch, torch.Tensor):
        raise TypeError(f"unexpected batch from the DP data loader: {type(batch).__name__}")
    return [int(i) for i in batch.reshape(-1).tolist()]


def _round_seeds(seed: int, steps_done: int) -> tuple[int, int]:
    """Seeds of Poisson sampling and of the noise for the round starting after ``steps_done``
    steps: fresh randomness every round (reusing the noise of an earlier round would break the
    independence the accountant assumes), yet reproducible."""
    sampling, noise = np.random.SeedSequence([seed, steps_done]).generate_state(2, dtype=np.uint64)
    return int(sampling), int(noise)


def _check_examples(examples: Sequence[Example]) -> None:
    if not examples:
        raise ValueError("DP-SGD needs at least one training example")
    for index, (ids, labels) in enumerate(examples):
        if not ids or len(ids) != len(labels):
            raise ValueError(
                f"example {index}: input_ids ({len(ids)}) and labels ({len(labels)}) must be "
                f"non-empty and of the same length"
            )


def _strip_opacus(model: torch.nn.Module) -> None:
    """Remove whatever Opacus may have left on parameters and modules."""
    from opacus.grad_sample.gsm_base import OPACUS_PARAM_MONKEYPATCH_ATTRS

    for p in model.parameters():
        for attr in (*OPACUS_PARAM_MONKEYPATCH_ATTRS, "summed_grad"):
            if hasattr(p, attr):
                delattr(p, attr)
        p.grad = None
    for module in model.modules():
        for attr in ("activations", "max_batch_len", "ft_compute_sample_grad"):
            if attr in module.__dict__:
                delattr(module, attr)
    if "autograd_grad_sample_hooks" in model.__dict__:
        delattr(model, "autograd_grad_sample_hooks")


def _run_steps(
    model: torch.nn.Module,
    examples: Sequence[Example],
    *,
    loader: DPDataLoader,
    optimizer: torch.optim.Optimizer,
    trained: list[torch.nn.Parameter],
    pad_token_id: int,
    steps: int,
    show_progress: bool,
) -> tuple[list[float], int]:
    """``steps`` DP-SGD steps over Poisson batches; returns the batch losses and the number of
    empty batches."""
    device = trained[0].device
    losses: list[float] = []
    empty = 0
    bar = tqdm(total=steps, desc="dp-sgd", disable=not show_progress, leave=False)
    done = 0
    while done < steps:
        for batch in loader:  # every pass draws fresh Poisson batches from the same generator
            indices = _batch_indices(batch)
            optimizer.zero_grad(set_to_none=True)
            if indices:
                padded = collate([examples[i] for i in indices], pad_token_id)
                loss = token_nll(model, {k: v.to(device) for k, v in padded.items()}).mean()
                loss.backward()
                losses.append(loss.item())
            else:  # what the hooks would leave after an empty forward/backward
                empty += 1
                for p in trained:
                    # Opacus keeps per-sample gradients on the parameter (no declared attribute)
                    p.grad_sample = torch.zeros(  # type: ignore[attr-defined]
                        (0, *p.shape), dtype=p.dtype, device=device
                    )
            optimizer.step()  # clip, noise, scale, account, SGD update
            done += 1
            bar.update(1)
            if done >= steps:
                break
    bar.close()
    optimizer.zero_grad(set_to_none=True)
    return losses, empty


def train_dp_sgd(
    model: torch.nn.Module,
    examples: Sequence[Example],
    *,
    pad_token_id: int,
    settings: DpSgdSettings,
    state: AccountantState,
    trainable: Callable[[str], bool] | None = None,
    show_progress: bool = False,
) -> tuple[dict[str, float], AccountantState]:
    """One round of DP-SGD: ``settings.steps_per_round`` steps on ``model``, in place.

    Every step draws a Poisson batch (each of the N examples with probability q), takes the
    per-example mean token NLL (:func:`~fedunlearn.training.batching.token_nll`; the batch
    loss is their mean, Opacus's ``loss_reduction="mean"`` undoes the 1/B so each example's
    gradient is clipped on its own), clips each example's gradient over all trained
    parameters to norm C, adds 𝒩(0, σ²C²), divides by the expected batch q·N and takes a plain
    SGD step. SGD rather than Adam: the update is exactly −lr·g (so ‖Δθ‖ ≤ lr·C without noise),
    and there is no optimiser state that a one-process-per-round client would lose anyway.

    Only parameters with ``trainable(name)`` true are trained (default: all); the others are
    frozen for the round. Afterwards every ``requires_grad`` flag and the train/eval mode are
    restored and all ``.grad`` are None.

    Opacus details handled here:

    * The model is not wrapped: ``make_private(wrap_model=False)`` attaches the hooks-mode
      grad samplers to the ``LlamaForCausalLM`` itself (``nn.Linear`` and ``nn.Embedding`` have
      Opacus grad samplers, ``LlamaRMSNorm`` goes through Opacus's functorch fallback; the
      rotary embedding only holds a buffer and no parameters, so the "trainable layer with
      buffers" validation passes). Afterwards the hooks are removed and every attribute Opacus
      put on parameters/modules (``grad_sample``, ``_forward_counter``, ``summed_grad``,
      ``activations``, ...) is deleted, also when training raises.
    * ``make_private`` derives q from ``1 / len(data_loader)``, which is only exact for
      q = 1/k. We hand it an Opacus ``DPDataLoader`` that already samples with the exact q
      (so ``poisson_sampling=False`` is passed to stop it from re-wrapping), then re-attach the
      accountant's step hook with the exact q and set the optimiser's expected batch to q·N.
    * Opacus refuses a model in eval mode, so the model is switched to train mode for the round
      (the tiny Llama has no dropout unless its config asks for it) and switched back after.
    * Empty Poisson batches: the data loader yields an empty index tensor (its empty-batch
      collator is told the batch structure up front, else it warns when the very first batch
      is empty); we skip the forward pass, give every trained parameter an empty per-example
      gradient ``[0, *shape]`` (what Opacus's hooks would produce) and still call ``step()``:
      the step adds pure noise and is counted by the accountant, as the Sampled Gaussian
      Mechanism requires.
    * Randomness: Poisson sampling and noise use ``torch.Generator``s seeded from
      ``(settings.seed, steps already recorded in state)``: same seed and state → identical
      weights, and every round gets fresh noise. Not Opacus's ``secure_mode`` (CSPRNG): fine
      for research, not for production guarantees against floating-point attacks.

    The steps are recorded into a copy of ``state``; the function refuses to run past the
    planned ``total_rounds · steps_per_round`` steps. Returns ``(stats, new_state)`` with stats
    ``loss_first``/``loss_last``/``loss_mean`` (batch-mean NLL of the first/last/all non-empty
    batches; NaN if every batch was empty), ``epsilon_spent`` (ε after this round, all rounds
    together, at ``settings.delta``), ``epsilon_target``, ``delta``, ``noise_multiplier`` (σ),
    ``sample_rate`` (q), ``max_grad_norm`` (C), ``steps``, ``total_steps``, ``empty_batches``.
    """
    from opacus import PrivacyEngine
    from opacus.data_loader import DPDataLoader

    _check_examples(examples)
    if state.total_steps + settings.steps_per_round > settings.total_steps:
        raise ValueError(
            f"the accountant already holds {state.total_steps} steps; another round of "
            f"{settings.steps_per_round} would exceed the {settings.total_steps} planned steps "
            f"({settings.total_rounds} rounds) that (ε={settings.epsilon}, δ={settings.delta}) "
            f"was calibrated for"
        )
    sigma = settings.resolved_noise_multiplier()
    q = settings.sample_rate
    n = len(examples)
    selected = [
        (name, p) for name, p in model.named_parameters() if trainable is None or trainable(name)
    ]
    if not selected:
        raise ValueError("no parameter is trainable: trainable(name) rejected them all")
    trained = [p for _, p in selected]
    trained_ids = {id(p) for p in trained}
    flags = [(p, p.requires_grad) for p in model.parameters()]
    was_training = model.training
    device = trained[0].device
    sampling_seed, noise_seed = _round_seeds(settings.seed, state.total_steps)

    hooks = None
    with warnings.catch_warnings():
        # Documented above: no secure RNG. The embedding's backward hook fires on its output
        # gradient because input ids need none, which is exactly what Opacus uses.
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        try:
            for p in model.parameters():
                p.requires_grad_(id(p) in trained_ids)
            model.train()  # Opacus's validator refuses a model in eval mode
            engine = PrivacyEngine(accountant="rdp", secure_mode=False)
            engine.accountant = state.to_accountant()
            loader = DPDataLoader(
                _IndexDataset(n),
                sample_rate=q,
                collate_fn=_collate_indices,
                generator=torch.Generator().manual_seed(sampling_seed),
            )
            # The empty-batch collator learns the batch structure from the first non-empty
            # batch and warns if the first one is empty; tell it the structure up front.
            if hasattr(loader.collate_fn, "first_batch"):
                loader.collate_fn.first_batch = [torch.zeros(0, dtype=torch.long)]
            hooks, optimizer, _ = engine.make_private(
                module=model,
                optimizer=torch.optim.SGD(trained, lr=settings.lr),
                data_loader=loader,
                noise_multiplier=sigma,
                max_grad_norm=settings.max_grad_norm,
                loss_reduction="mean",
                poisson_sampling=False,  # the loader above already samples with the exact q
                noise_generator=torch.Generator(device=device).manual_seed(noise_seed),
                grad_sample_mode="hooks",
                wrap_model=False,
            )
            optimizer.attach_step_hook(engine.accountant.get_optimizer_hook_fn(sample_rate=q))
            optimizer.expected_batch_size = q * n  # make_private would use int(n / len(loader))
            hooks.forbid_grad_accumulation()
            losses, empty = _run_steps(
                model,
                examples,
                loader=loader,
                optimizer=optimizer,
                trained=trained,
                pad_token_id=pad_token_id,
                steps=settings.steps_per_round,
                show_progress=show_progress,
            )
            new_state = AccountantState.from_accountant(engine.accountant)
        finally:
            if hooks is not None:
                hooks.cleanup()
            _strip_opacus(model)
            for p, flag in flags:
                p.requires_grad_(flag)
            model.train(was_training)

    stats = {
        "loss_first": losses[0] if losses else math.nan,
        "loss_last": losses[-1] if losses else math.nan,
        "loss_mean": float(np.mean(losses)) if losses else math.nan,
        "epsilon_spent": new_state.epsilon(settings.delta),
        "epsilon_target": float(settings.epsilon),
        "delta": float(settings.delta),
        "noise_multiplier": sigma,
        "sample_rate": float(q),
        "max_grad_norm": float(settings.max_grad_norm),
        "steps": float(settings.steps_per_round),
        "total_steps": float(new_state.total_steps),
        "empty_batches": float(empty),
    }
    return stats, new_state
