"""The DPO stage's preference losses: one function per loss, and the registry that names them.

``training.loss_type`` (a ``trl.DPOConfig`` key; one name or a list, weighted by
``training.loss_weights`` as TRL weighs them) names the losses of :data:`LOSSES`. Each is a plain
function of one batch's per-sequence log-probs (:class:`PairLogps`) and ``beta``, returning a
scalar; :func:`combined` sums them. Every log-prob layout of the stage's own path (``log_probs:
auto | sequence | side | packed``, :mod:`online_rlhf.completion_logps`) computes the loss here.
``log_probs: trl`` runs TRL's own ``DPOTrainer._compute_loss`` instead (TRL's implementations, of
every name in :data:`TRL_LOSS_TYPES`); tests/test_completion_logps.py checks that the functions
below give TRL's loss, log-probs and gradients for the names both know.

Add a loss (docs/dpo.md, "Change the loss"): write one function ``(p: PairLogps, beta: float) ->
scalar tensor`` below, put ``@register("<name>")`` on it, and set ``dpo.training.loss_type=<name>``
(or list it beside the others). A name TRL does not know runs in the stage's own layouts only: the
config check accepts a registered name (:func:`unknown_loss_types`), ``log_probs: trl`` refuses it.
The test to copy: ``tests/test_dpo_loss.py::test_a_loss_added_in_one_function_trains``.
Importable without torch (each loss imports it when it runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

# The names TRL 1.9's ``DPOTrainer._compute_loss`` computes (its ``trl.DPOConfig.loss_type`` help
# lists them; tests/test_dpo_loss.py ties the two): a loss_type outside these and :data:`LOSSES`
# is refused before training.
TRL_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                  "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")


@dataclass
class PairLogps:
    """One batch of B pairs as every loss sees it; log-probs in nats, summed over completion tokens.

    Attributes:
        chosen, rejected: (B,) the policy's summed log-probs of the chosen / rejected completions.
        ref_chosen, ref_rejected: (B,) the reference's, without gradients.
        chosen_tokens, rejected_tokens: (B,) completion token counts.
        chosen_token_logps: (Mc,) the policy's log-prob of every chosen completion token of the batch.
        chosen_ratio, rejected_ratio: (B,) ``chosen - ref_chosen``, ``rejected - ref_rejected``
            (log pi/pi_ref of each side), computed once here.
        delta: (B,) ``chosen_ratio - rejected_ratio``, the implicit reward margin over beta.
    """

    chosen: Any
    rejected: Any
    ref_chosen: Any
    ref_rejected: Any
    chosen_tokens: Any
    rejected_tokens: Any
    chosen_token_logps: Any
    chosen_ratio: Any = field(init=False)
    rejected_ratio: Any = field(init=False)
    delta: Any = field(init=False)

    def __post_init__(self) -> None:
        self.chosen_ratio = self.chosen - self.ref_chosen
        self.rejected_ratio = self.rejected - self.ref_rejected
        self.delta = self.chosen_ratio - self.rejected_ratio


# (pairs, beta) -> scalar loss tensor (the mean over the batch, or what the loss defines)
LossFn = Callable[[PairLogps, float], Any]
LOSSES: dict[str, LossFn] = {}


def register(name: str) -> Callable[[LossFn], LossFn]:
    """Decorator: name a loss function for ``training.loss_type``.

    Raises:
        ValueError: ``name`` is registered already (two functions for one name).
    """
    def add(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss_type {name!r} is registered already ({LOSSES[name].__module__}."
                             f"{LOSSES[name].__qualname__}); give the new loss another name")
        LOSSES[name] = fn
        return fn
    return add


@register("sigmoid")
def sigmoid(p: PairLogps, beta: float):
    """DPO: ``-log sigmoid(beta d)``, the mean over the B pairs (Rafailov et al. 2023, eq. 7)."""
    import torch.nn.functional as F

    return (-F.logsigmoid(beta * p.delta)).mean()


@register("hinge")
def hinge(p: PairLogps, beta: float):
    """SLiC-HF: ``max(0, 1 - beta d)``, the mean over the B pairs (Zhao et al. 2023)."""
    return (1 - beta * p.delta).clamp(min=0).mean()


@register("ipo")
def ipo(p: PairLogps, beta: float):
    """IPO: ``(d' - 1/(2 beta))^2``, the mean over the B pairs, with each side's log-ratio divided
    by its completion token count (Azar et al. 2023, eq. 17; length-normalised as TRL does)."""
    norm = p.chosen_ratio / p.chosen_tokens.clamp(min=1) - p.rejected_ratio / p.rejected_tokens.clamp(min=1)  # (B,)
    return ((norm - 1 / (2 * beta)) ** 2).mean()


@register("sft")
def sft(p: PairLogps, beta: float):
    """The negative log-likelihood of the chosen completions: the mean over all their tokens of the
    batch (TRL's cross-entropy term; with ``sigmoid``, Iterative RPO, Pang et al. 2024)."""
    return -p.chosen_token_logps.mean()


def combined(loss_types: Iterable[str], loss_weights: Iterable[float], p: PairLogps, beta: float):
    """``sum(weight x LOSSES[name](p, beta))`` over ``loss_types`` and their ``loss_weights``, in order.

    Raises:
        ValueError: a name that is not registered, or as many weights as names.
    """
    loss = 0.0
    for name, weight in zip(loss_types, loss_weights, strict=True):
        fn = LOSSES.get(name)
        if fn is None:
            raise ValueError(f"loss_type {name!r} is not computed in online_rlhf/dpo_loss.py; registered: "
                             f"{', '.join(LOSSES)}")
        loss = loss + weight * fn(p, beta)
    return loss


def unknown_loss_types(loss_type: str | list) -> list[str]:
    """The names of a ``training.loss_type`` value (one name or a list) that neither TRL
    (:data:`TRL_LOSS_TYPES`) nor this module (:data:`LOSSES`) computes."""
    names = [loss_type] if isinstance(loss_type, str) else list(loss_type or [])
    return [n for n in names if not (isinstance(n, str) and (n in LOSSES or n in TRL_LOSS_TYPES))]


def project_only_loss_types(loss_type: str | list) -> list[str]:
    """The names of a ``training.loss_type`` value that only this module computes (TRL's own
    ``_compute_loss``, ``log_probs: trl``, cannot)."""
    names = [loss_type] if isinstance(loss_type, str) else list(loss_type or [])
    return [n for n in names if isinstance(n, str) and n in LOSSES and n not in TRL_LOSS_TYPES]
