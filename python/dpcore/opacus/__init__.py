"""dpcore.opacus: a drop-in for Opacus training scripts.

Change the import lines, ``opacus`` → ``dpcore.opacus``, and nothing else::

    from dpcore.opacus import PrivacyEngine
    from dpcore.opacus.utils.batch_memory_manager import BatchMemoryManager
    from dpcore.opacus.validators import ModuleValidator

    model = ModuleValidator.fix(model)               # BatchNorm -> GroupNorm
    privacy_engine = PrivacyEngine()                 # accountant="prv" -> dpcore's PLD
    model, optimizer, train_loader = privacy_engine.make_private(
        module=model, optimizer=optimizer, data_loader=train_loader,
        noise_multiplier=1.1, max_grad_norm=1.0)
    with BatchMemoryManager(data_loader=train_loader, max_physical_batch_size=64,
                            optimizer=optimizer) as loader:
        for x, y in loader: ...
    eps = privacy_engine.get_epsilon(delta=1e-5)

Training runs on :mod:`dpcore.torch` (ChaCha20 sampling and noise, per-record gradients by
dpcore's layer rules, every sample and release in a :class:`dpcore.PrivacyLedger`); the
accounting reads the ledger. Where dpcore's behaviour differs from Opacus's it is dpcore's
(see the "Coming from Opacus" page): ``poisson_sampling=False`` is accounted as shuffled
batches (no amplification), Opacus's ``"prv"`` and ``"gdp"`` accountants are dpcore's PLD
accountant, ``secure_mode`` is always on.
"""

from ._engine import GradSampleModule, PrivacyEngine, PrivacyLedgerAccountant

__all__ = ["PrivacyEngine", "GradSampleModule", "PrivacyLedgerAccountant"]
