"""What packkit relies on in TRL, in one place: ``DPOTrainer``'s private loss hook, its config as the trainer holds
it, and its metrics; and the training versions of chat templates TRL ships (:func:`training_template`).

:class:`DPOLossHook` overrides ``trl.DPOTrainer._compute_loss(self, model, inputs, return_outputs)`` (private:
``compute_loss`` calls it with the batch Trainer moved), refuses what a packed batch does not compute, read from the
trainer's own attributes (``loss_types``, ``f_divergence_type``, ``ld_alpha``, ``use_weighting``,
``aux_loss_enabled``, ``precompute_ref_logps``, ``ref_model``), weights the loss by ``loss_weights`` and logs what
``DPOTrainer`` logs (``_metrics[mode]``, ``_total_train_tokens``, ``accelerator.gather``). The loss itself is
packkit's: a subclass supplies ``_packed_dpo_loss`` (:class:`packkit.preference.PackedDPOMixin`).

Checked against TRL 1.16 (``tests/test_integrations.py`` fails when the installed version leaves
:data:`SUPPORTED`, and checks the hook's signature and the attributes read: widen the range there after checking;
TRL reworks ``DPOTrainer``'s internals between minor releases).
"""

from __future__ import annotations

from .. import integrations
from ..errors import ArgumentError

__all__ = ["SUPPORTED", "CONFIG_ATTRIBUTES", "installed_version", "is_supported", "training_template",
           "DPOLossHook"]

#: ``[first, past)``: the TRL releases this module is checked against (major.minor).
SUPPORTED = ((1, 16), (1, 17))

#: The ``DPOTrainer`` attributes :class:`DPOLossHook` reads (``use_weighting`` and ``aux_loss_enabled`` may be
#: absent: read as False).
CONFIG_ATTRIBUTES = ("loss_types", "f_divergence_type", "ld_alpha", "precompute_ref_logps", "ref_model", "beta",
                     "loss_weights", "_metrics", "_total_train_tokens", "accelerator")


def installed_version() -> str | None:
    """trl's version string, or None when it is not installed."""
    return integrations.installed_version("trl")


def is_supported(version: str) -> bool:
    """``is_supported("1.16.0") -> True``; ``"1.15.2"`` and ``"1.17.0"`` -> False (outside :data:`SUPPORTED`)."""
    return integrations.is_supported(version, SUPPORTED)


def training_template(tokenizer, template: str | None = None) -> str | None:
    """TRL's training version, with ``{% generation %}`` markers, of ``tokenizer``'s chat template (or of ``template``,
    passed instead, as TRL's ``chat_template_path``), when TRL is installed and knows it; else None. TRL's
    ``SFTTrainer(assistant_only_loss=True)`` swaps the same template in, so loss counts made here match what it trains
    on. The templates are TRL's: packkit ships none."""
    try:
        from trl.chat_template_utils import get_training_chat_template
    except ImportError:
        return None
    own = tokenizer.chat_template
    try:
        if template is not None:  # TRL reads the template off the tokenizer: set for the call, then restored
            tokenizer.chat_template = template
        return get_training_chat_template(tokenizer)
    except (ValueError, TypeError):
        return None
    finally:
        tokenizer.chat_template = own


class DPOLossHook:
    """Mixed in before ``trl.DPOTrainer``: its private ``_compute_loss`` computed by ``self._packed_dpo_loss(model,
    ref_model, inputs, beta=...) -> (loss, outputs, policy, reference)`` (``policy`` / ``reference``: per-pair
    ``.chosen`` / ``.rejected`` log-probabilities, ``(pairs,)`` tensors), with TRL's loss weight and metrics."""

    def _packed_dpo_unsupported(self) -> str | None:
        checks = (
            (list(self.loss_types) != ["sigmoid"], f"loss_type={self.loss_types!r} (only 'sigmoid')"),
            (self.f_divergence_type != "reverse_kl", f"f_divergence_type={self.f_divergence_type!r}"),
            (self.ld_alpha is not None, "ld_alpha"),
            (getattr(self, "use_weighting", False), "use_weighting"),
            (getattr(self, "aux_loss_enabled", False), "a MoE auxiliary loss (router_aux_loss_coef)"),
            (self.precompute_ref_logps, "precompute_ref_log_probs"),
            (self.ref_model is None, "no ref_model (a PEFT adapter as reference)"),
        )
        return next((why for bad, why in checks if bad), None)

    def _compute_loss(self, model, inputs, return_outputs):
        why = self._packed_dpo_unsupported()
        if why is not None:
            raise ArgumentError(f"packed DPO computes TRL's sigmoid DPO loss only; this config asks for {why}: use "
                                "trl.DPOTrainer without packing for it")
        loss, outputs, policy, reference = self._packed_dpo_loss(model, self.ref_model, inputs, beta=self.beta)
        loss = loss * (self.loss_weights[0] if self.loss_weights else 1.0)
        mode = "train" if self.model.training else "eval"
        metrics, gather = self._metrics[mode], self.accelerator.gather
        chosen = self.beta * (policy.chosen - reference.chosen).detach()
        rejected = self.beta * (policy.rejected - reference.rejected).detach()
        if mode == "train":
            self._total_train_tokens += int(inputs.num_real_tokens)
        metrics["num_tokens"] = [self._total_train_tokens]
        metrics["rewards/chosen"].append(gather(chosen).mean().item())
        metrics["rewards/rejected"].append(gather(rejected).mean().item())
        metrics["rewards/accuracies"].append(gather((chosen > rejected).float()).mean().item())
        metrics["rewards/margins"].append(gather(chosen - rejected).mean().item())
        metrics["logps/chosen"].append(gather(policy.chosen.detach()).mean().item())
        metrics["logps/rejected"].append(gather(policy.rejected.detach()).mean().item())
        return (loss, outputs) if return_outputs else loss
