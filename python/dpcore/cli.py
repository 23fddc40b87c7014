"""The ``dpcore`` command line (also ``python -m dpcore``): a thin layer over the Python API.

* ``dpcore epsilon -q Q -z Z (--steps T | --epochs E) --delta D``: ε of DP-SGD under the
  default accountant (PLD), with RDP beside it and the PLD lower bound
  (:func:`dpcore.accounting.epsilon`, :class:`dpcore.accounting.PldAccountant`).
* ``dpcore calibrate --epsilon E --delta D`` with two of ``-q``, ``-z``, ``--steps/--epochs``:
  the missing one (:mod:`dpcore.accounting.calibration`).
* ``--noise-mechanism banded|blt`` (both commands): a matrix-factorization (correlated noise,
  DP-FTRL) mechanism instead of DP-SGD (``gaussian``, the default), with ``--min-separation B`` (records cut once into B fixed
  batches, batch t mod B at step t), ``--steps N`` or ``--epochs E`` (E·B steps), and ``-q P``
  for cyclic Poisson sampling (each record of the group with probability P). ``-z`` is the
  *effective* noise multiplier σ/(S·sens); ``--strategy FILE`` (a strategy's JSON,
  ``strategy.to_dict()``, e.g. ``{"kind": "banded", "coefficients": [1.0, 0.6, 0.2]}``) adds
  its sensitivity and the stddev σ = z·S·sens to use (:mod:`dpcore.matrix_factorization`).
* ``--privacy-unit user`` (both commands): a guarantee for a user. ``--examples-per-user K``:
  user-level sampling, the ordinary command over the user population (-q the rate of a user);
  ``--max-examples-per-user K``: example-level sampling with each user's data bounded to K
  examples, the user accounted as a mixture of Gaussians by PLD, with the example-level ε and the
  group-privacy bound beside it (:func:`dpcore.events.example_level_sampling_event`).
* ``dpcore report LEDGER --delta D [--format markdown|json]``: the privacy report
  (:meth:`dpcore.PrivacyLedger.report`); ``--study DIR_OR_FILE`` instead of a ledger: the
  report of a hyperparameter-tuning study (:class:`dpcore.study.Study`).
* ``dpcore plot LEDGER --delta D -o eps.png``: ε against steps under PLD and RDP
  (:meth:`dpcore.PrivacyLedger.epsilon_curve`; needs ``dpcore[plot]``).
* ``dpcore audit -z Z``: a one-run privacy audit of the mechanism (:mod:`dpcore.audit`): the
  Steinke and f-DP lower bounds on ε and the Gaussian-DP fit beside the claim; exit code 3
  (:data:`AUDIT_FAILED`) when a lower bound exceeds the claim, so that it can gate a CI job.
* ``dpcore demo``: DP logistic regression on the digits data.

Exit codes: 0 success, 2 bad arguments (argparse's convention), 1 bad data (an unreadable or
corrupt ledger, a target that cannot be met); the error is one line on stderr, never a
traceback. ``--json`` prints one JSON object on stdout. Progress goes to stderr (tqdm).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Dict, List, Optional

from ._cli_options import (  # noqa: F401 (epsilon_summary, mf_summary, sampler_table, DataError: public here)
    DataError,
    NOISE_MECHANISMS,
    _check_sampler_args,
    _mf,
    _mf_text,
    _noise_mechanism,
    _participation,
    _sampler_kw,
    _strategy,
    ELS,
    ULS,
    check_privacy_unit,
    els_summary,
    els_text,
    epsilon_summary,
    mf_summary,
    sampler_table,
    user_level_options,
    uls_note,
)


def _float(name: str, lo: float, hi: float, lo_open: bool, hi_open: bool = False) -> Any:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
        if not ok:
            lo_b, hi_b = "(" if lo_open else "[", ")" if hi_open else "]"
            raise argparse.ArgumentTypeError(f"{name} must be in {lo_b}{lo:g}, {hi:g}{hi_b}, got {text}")
        return v

    return parse


def _count(name: str, lo: int = 1) -> Any:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if v < lo or v >= 1 << 53:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= {lo}, got {text}")
        return v

    return parse


def _epochs(text: str) -> float:
    return _float("--epochs", 0.0, math.inf, True, True)(text)


_Q = _float("-q (sampling probability)", 0.0, 1.0, True)
_Z = _float("-z (noise multiplier)", 0.0, math.inf, True, True)
_DELTA = _float("--delta", 0.0, 1.0, True, True)
_EPS = _float("--epsilon", 0.0, math.inf, True, True)


def _steps_of(args: argparse.Namespace, parser: argparse.ArgumentParser, q: Optional[float]) -> Optional[int]:
    if args.steps is not None and args.epochs is not None:
        parser.error("give --steps or --epochs, not both")
    if _mf(args):
        if args.min_separation is None:
            parser.error(f"--noise-mechanism {args.noise_mechanism} needs --min-separation (the batches of one epoch: a "
                         "record takes part at most once every that many steps)")
        if args.epochs is not None:
            return max(1, math.ceil(args.epochs * args.min_separation))
        return args.steps
    for flag in ("min_separation", "strategy"):
        if getattr(args, flag) is not None:
            parser.error(f"--{flag.replace('_', '-')} is a matrix-factorization option; add --noise-mechanism banded (or blt)")
    if args.epochs is not None:
        if q is None:
            parser.error("--epochs needs -q (an epoch is 1/q steps)")
        # the plan's formula, the one every front end uses (dpcore.plan.steps_for_epochs)
        from .plan import steps_for_epochs

        sampler = getattr(args, "sampler", None)
        sampler = "poisson" if sampler in (None, "all") else sampler
        opts: Dict[str, Any] = {}
        if sampler == "random_allocation":
            opts["num_selected"] = getattr(args, "num_selected", 1)
        spe = getattr(args, "steps_per_epoch", None) if sampler in ("shuffle", "sequential", "cyclic") else None
        try:
            return steps_for_epochs(sampler, args.epochs, q, steps_per_epoch=spe, **opts)
        except ValueError as e:
            parser.error(str(e))
    return args.steps


# -- the subcommands -----------------------------------------------------------------------


def _cmd_epsilon(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Dict[str, Any]:
    _noise_mechanism(args, parser)
    steps = _steps_of(args, parser, args.q)
    if steps is None:
        parser.error("give --steps or --epochs")
    unit = check_privacy_unit(args, parser)
    if unit == ULS:  # the ordinary command, over the user population
        k, args.privacy_unit, args.examples_per_user = args.examples_per_user, "example", None
        return uls_note(_cmd_epsilon(args, parser), k)
    sampler = _check_sampler_args(args, parser)
    if unit == ELS:
        with _Spinner("accounting"):
            out = els_summary(args.q, args.z, steps, args.delta, args.max_examples_per_user)
        out["neighboring"] = args.neighboring or "add_or_remove"  # zero-out reads the same pair
        out["text"] = (
            f"user-level ε = {out['epsilon']:.6g} at δ = {args.delta:g} (pld, {out['neighboring']}) after {steps} steps, "
            f"q = {args.q:g}, σ = {args.z:g} (lower bound {out['epsilon_pld_lower_bound']:.6g})\n" + els_text(out)
        )
        return out
    if sampler == "all":
        with _Spinner("accounting"):
            return sampler_table(args, parser, steps)
    if sampler is not None:
        from .accounting.samplers import GUARANTEES, default_accountant, sampler_epsilon

        acct = default_accountant(sampler, args.accountant)
        kw = _sampler_kw(args, parser, sampler)
        rel = kw["neighboring"]
        with _Spinner("accounting"):
            try:
                eps = sampler_epsilon(sampler, args.z, steps, args.delta, accountant=acct, **kw)
            except ValueError as e:
                raise DataError(str(e)) from None
            poisson = sampler_epsilon("poisson", args.z, steps, args.delta, sampling_probability=args.q,
                                      neighboring="zero_out" if rel == "zero_out" else "add_or_remove")
        same = "" if rel != "replace_one" else " (under add_or_remove: not comparable)"
        return {
            "epsilon": eps, "accountant": acct, "delta": args.delta, "sampler": sampler, "sampling_probability": args.q,
            "noise_multiplier": args.z, "steps": steps, "neighboring": rel, "epsilon_poisson_same_rate": poisson,
            "text": (
                f"ε = {eps:.6g} at δ = {args.delta:g} ({acct}, {rel}) after {steps} steps of {sampler} sampling, "
                f"q = {args.q:g}, σ = {args.z:g}\n  Poisson sampling at the same rate: ε = {poisson:.6g} (pld){same}\n"
                f"  {GUARANTEES[sampler]}"
            ),
        }
    args.accountant = args.accountant or "pld"
    if _mf(args):
        part = _participation(args)
        strategy = _strategy(args.strategy, part, args.noise_mechanism)
        with _Spinner("accounting"):
            out = mf_summary(part, args.z, steps, args.delta, args.accountant, strategy)
        out["noise_mechanism"] = args.noise_mechanism
        out["text"] = (
            f"ε = {out['epsilon']:.6g} at δ = {args.delta:g} ({args.accountant}) at effective noise multiplier "
            f"z = σ/(S·sens) = {args.z:g}\n  PLD {out['epsilon_pld']:.6g} (lower bound {out['epsilon_pld_lower_bound']:.6g}), "
            f"RDP {out['epsilon_rdp']:.6g}\n  " + _mf_text(out)
        )
        return out
    if args.q is None:
        parser.error("DP-SGD needs -q (the sampling probability)")
    with _Spinner("accounting"):
        out = epsilon_summary(args.q, args.z, steps, args.delta, args.accountant)
    out["text"] = (
        f"ε = {out['epsilon']:.6g} at δ = {args.delta:g} ({args.accountant}) after {steps} steps, q = {args.q:g}, "
        f"σ = {args.z:g}\n  PLD {out['epsilon_pld']:.6g} (lower bound {out['epsilon_pld_lower_bound']:.6g}), "
        f"RDP {out['epsilon_rdp']:.6g}"
    )
    return out


def _cmd_calibrate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Dict[str, Any]:
    from .accounting import calibrate_noise_multiplier, calibrate_sampling_probability, calibrate_steps

    _noise_mechanism(args, parser)
    steps = _steps_of(args, parser, args.q)
    unit = check_privacy_unit(args, parser)
    if unit == ULS:  # the ordinary command, over the user population
        k, args.privacy_unit, args.examples_per_user = args.examples_per_user, "example", None
        return uls_note(_cmd_calibrate(args, parser), k)
    sampler = _check_sampler_args(args, parser)
    if unit == ELS:
        return _calibrate_els(args, parser, steps)
    if sampler == "all":
        parser.error("--sampler all is for `dpcore epsilon`; calibrate for one sampler")
    if sampler is not None:
        return _calibrate_sampler(args, parser, sampler, steps)
    args.accountant = args.accountant or "pld"
    if _mf(args):
        return _calibrate_mf(args, parser, steps)
    given = [args.q is not None, args.z is not None, steps is not None]
    if sum(given) != 2:
        parser.error("give exactly two of -q, -z and --steps/--epochs; the third is calibrated")
    out: Dict[str, Any] = {"epsilon": args.epsilon, "delta": args.delta, "accountant": args.accountant}
    with _Spinner("calibrating"):
        if args.z is None:
            z = calibrate_noise_multiplier(args.epsilon, args.delta, args.q, steps, accountant=args.accountant)
            out.update(noise_multiplier=z, sampling_probability=args.q, steps=steps)
            text = f"noise multiplier σ = {z:.6g} (q = {args.q:g}, {steps} steps)"
        elif args.q is None:
            q = calibrate_sampling_probability(args.epsilon, args.delta, args.z, steps, accountant=args.accountant)
            if q <= 0.0:
                raise DataError(f"no sampling probability reaches ε = {args.epsilon:g} with σ = {args.z:g} and {steps} steps")
            out.update(sampling_probability=q, noise_multiplier=args.z, steps=steps)
            text = f"sampling probability q = {q:.6g} (σ = {args.z:g}, {steps} steps)"
        else:
            t = calibrate_steps(args.epsilon, args.delta, args.q, args.z, accountant=args.accountant)
            if t <= 0:
                raise DataError(f"not even one step stays within ε = {args.epsilon:g} at q = {args.q:g}, σ = {args.z:g}")
            out.update(steps=t, sampling_probability=args.q, noise_multiplier=args.z)
            text = f"steps = {t} (q = {args.q:g}, σ = {args.z:g}; {t * args.q:.4g} epochs)"
    out["text"] = f"{text} for ε = {args.epsilon:g} at δ = {args.delta:g} ({args.accountant})"
    return out


def _calibrate_els(args: argparse.Namespace, parser: argparse.ArgumentParser, steps: Optional[int]) -> Dict[str, Any]:
    """The noise multiplier of ELS for a user-level target (:func:`dpcore.plan.calibrate_noise`
    with ``max_examples_per_user``)."""
    from .plan import calibrate_noise

    if steps is None or args.z is not None:
        parser.error("--max-examples-per-user calibrates the noise multiplier: give -q and --steps (or --epochs), not -z")
    k = args.max_examples_per_user
    with _Spinner("calibrating"):
        z = calibrate_noise(args.epsilon, args.delta, sampler="poisson", sampling_probability=args.q, steps=steps,
                            neighboring=args.neighboring, max_examples_per_user=k)
        summary = els_summary(args.q, z, steps, args.delta, k)
    out: Dict[str, Any] = {key: v for key, v in summary.items() if not key.startswith("epsilon")}
    out.update(epsilon=args.epsilon, delta=args.delta, epsilon_achieved=summary["epsilon"],
               epsilon_group_privacy=summary["epsilon_group_privacy"])
    out["text"] = (
        f"noise multiplier σ = {z:.6g} (q = {args.q:g}, {steps} steps) for user-level ε = {args.epsilon:g} at "
        f"δ = {args.delta:g} (pld; achieved {summary['epsilon']:.6g})\n" + els_text(summary)
    )
    return out


def _calibrate_sampler(args: argparse.Namespace, parser: argparse.ArgumentParser, sampler: str, steps: Optional[int]) -> Dict[str, Any]:
    """Noise multiplier or steps for a target ε under one sampler's own accounting (the rate
    -q fixes the sampler's batches, so it is not calibrated here)."""
    from .accounting.samplers import calibrate_sampler_steps, default_accountant
    from .plan import calibrate_noise

    if (args.z is None) == (steps is None):
        parser.error(f"--sampler {sampler}: give -q and one of -z and --steps/--epochs; the other is calibrated")
    acct = default_accountant(sampler, args.accountant)
    kw = _sampler_kw(args, parser, sampler)
    out: Dict[str, Any] = {"epsilon": args.epsilon, "delta": args.delta, "accountant": acct, "sampler": sampler,
                           "sampling_probability": args.q, "neighboring": kw["neighboring"]}
    with _Spinner("calibrating"):
        if args.z is None:
            z = calibrate_noise(args.epsilon, args.delta, sampler=sampler, steps=steps, accountant=acct, **kw)
            out.update(noise_multiplier=z, steps=steps)
            text = f"noise multiplier σ = {z:.6g} ({sampler} sampling, q = {args.q:g}, {steps} steps)"
        else:
            t = calibrate_sampler_steps(args.epsilon, args.delta, sampler, args.z, accountant=acct, **kw)
            if t <= 0:
                raise DataError(f"not even one step (or round) stays within ε = {args.epsilon:g} at q = {args.q:g}, σ = {args.z:g}")
            out.update(steps=t, noise_multiplier=args.z)
            text = f"steps = {t} ({sampler} sampling, q = {args.q:g}, σ = {args.z:g}; {t * args.q:.4g} epochs)"
    out["text"] = f"{text} for ε = {args.epsilon:g} at δ = {args.delta:g} ({acct}, {kw['neighboring']})"
    return out


def _calibrate_mf(args: argparse.Namespace, parser: argparse.ArgumentParser, steps: Optional[int]) -> Dict[str, Any]:
    from .matrix_factorization import calibrate_noise_multiplier

    if steps is None or args.z is not None:
        parser.error(f"--noise-mechanism {args.noise_mechanism} calibrates the noise multiplier: give --steps or --epochs, not -z")
    part = _participation(args)
    strategy = _strategy(args.strategy, part, args.noise_mechanism)
    with _Spinner("calibrating"):
        z = calibrate_noise_multiplier(args.epsilon, args.delta, participation=part, steps=steps, accountant=args.accountant)
        summary = mf_summary(part, z, steps, args.delta, args.accountant, strategy)
    out: Dict[str, Any] = {k: v for k, v in summary.items() if not k.startswith("epsilon")}
    out["noise_mechanism"] = args.noise_mechanism
    out.update(epsilon=args.epsilon, delta=args.delta, accountant=args.accountant, epsilon_achieved=summary["epsilon"])
    out["text"] = (
        f"effective noise multiplier z = σ/(S·sens) = {z:.6g} for ε = {args.epsilon:g} at δ = {args.delta:g} "
        f"({args.accountant})\n  " + _mf_text(summary)
    )
    return out


def _load(path: str) -> Any:
    import warnings

    from .ledger import LedgerError, PrivacyLedger

    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory, not a ledger file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the report lists what matters (a torn tail)
            return PrivacyLedger.load(path)
    except LedgerError as e:
        raise DataError(str(e)) from None
    except OSError as e:
        raise DataError(f"{path}: {e.strerror or e}") from None


def _cmd_report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    fmt = "json" if args.json else args.format
    if args.study is not None:
        if args.ledger is not None:
            parser.error("give a ledger or --study, not both")
        return _study_report(args, fmt)
    if args.ledger is None:
        parser.error("give a ledger (or --study DIR_OR_FILE for a tuning study)")
    led = _load(args.ledger)
    with _Spinner("accounting the ledger"):
        try:
            rep = led.report(args.delta, neighboring=args.neighboring, accountant=args.accountant)
        except ValueError as e:
            raise DataError(f"{args.ledger}: {e}") from None
    if fmt == "json":
        return rep.to_dict()
    return _Text(rep.to_markdown().rstrip("\n"))


def _study_report(args: argparse.Namespace, fmt: str) -> Any:
    """``dpcore report --study``: the report of a hyperparameter-tuning study (:mod:`dpcore.study`)."""
    from .study import Study, StudyError

    with _Spinner("accounting the study"):
        try:
            rep = Study.load(args.study).report(args.delta, neighboring=args.neighboring, accountant=args.accountant)
        except StudyError as e:
            raise DataError(str(e)) from None
        except OSError as e:
            raise DataError(f"{args.study}: {e.strerror or e}") from None
    if fmt == "json":
        return rep.to_dict()
    return _Text(rep.to_text().rstrip("\n"))


def _cmd_plot(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Dict[str, Any]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DataError("plotting needs matplotlib: pip install 'dpcore[plot]'") from None
    led = _load(args.ledger)
    accountants = ["pld", "rdp"]
    total = len(accountants) * min(args.points, max(1, led.num_releases))
    with _Progress(total, "ε curve") as bar:
        try:
            curve = led.epsilon_curve(args.delta, points=args.points, accountants=accountants, progress=bar.update_to)
        except ValueError as e:
            raise DataError(f"{args.ledger}: {e}") from None
    if not curve["steps"]:
        raise DataError(f"{args.ledger}: the ledger holds no release to plot")
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for a, style in (("pld", "-"), ("rdp", "--")):
        line = ax.plot(curve["steps"], curve[a], style, label=f"{a.upper()} (final ε = {curve['final'][a]:.4g})")[0]
        ax.plot([curve["steps"][-1]], [curve["final"][a]], "o", color=line.get_color(), ms=4)
    ax.set_xlabel("releases (steps); curve on a coarser PLD grid, dots: the ledger's ε")
    ax.set_ylabel(f"ε at δ = {args.delta:g}")
    ax.set_title(f"{os.path.basename(args.ledger)}: privacy spent")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(args.output, format="png")
    except OSError as e:
        raise DataError(f"{args.output}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return {
        "output": args.output,
        "points": len(curve["steps"]),
        "epsilon_pld": curve["final"]["pld"],
        "epsilon_rdp": curve["final"]["rdp"],
        "text": f"wrote {args.output} ({len(curve['steps'])} points; final ε: PLD {curve['final']['pld']:.6g}, "
        f"RDP {curve['final']['rdp']:.6g})",
    }


#: Exit code of ``dpcore audit`` when a lower bound exceeds the claim (the audit failed); the
#: result is printed first, as on success. 1 and 2 keep their meaning (bad data, bad arguments).
AUDIT_FAILED = 3


def _cmd_audit(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Dict[str, Any]:
    from .audit import one_run_audit

    with _Progress(args.steps, "auditing") as bar:
        res = one_run_audit(
            args.z,
            steps=args.steps,
            sampling_probability=args.q,
            canaries=args.canaries,
            actual_noise_multiplier=args.actual_noise_multiplier,
            delta=args.delta,
            confidence=args.confidence,
            progress=lambda done, total: bar.update_to(done),
        )
    out = res.to_dict()
    out["exit_code"] = 0 if res.passed else AUDIT_FAILED
    fit = res.gdp_fit
    if res.fdp_curve == "gaussian":
        fdp_how = f"Gaussian curves: μ ≥ {res.mu_lower_bound:.4g}, claimed μ = {res.mu_claimed:.4g}"
    else:
        fdp_how = f"(ε, δ) curves; μ ≥ {res.mu_lower_bound:.4g} for μ-GDP"
    verdict = "passed" if res.passed else "FAILED: a lower bound exceeds the claim"
    out["text"] = (
        f"audit {verdict}\n"
        f"  claimed ε                            {res.epsilon_claimed:.4g} at δ = {res.delta:g}\n"
        f"  lower bound, Steinke et al. 2023     ε ≥ {res.epsilon_lower_bound_steinke:.4g}\n"
        f"  lower bound, f-DP (Mahloujifar+ 25)  ε ≥ {res.epsilon_lower_bound_fdp:.4g} ({fdp_how})\n"
        f"  Gaussian-DP fit (estimate, no bound) ε ≈ {fit['epsilon']:.4g} (μ ≈ {fit['mu']:.3g}, "
        f"[{fit['mu_interval'][0]:.3g}, {fit['mu_interval'][1]:.3g}]; AUROC {fit['auroc']:.3f}, "
        f"TPR {fit['tpr_at_fpr']['0.01']:.3f} at FPR 1%, {fit['tpr_at_fpr']['0.001']:.3f} at 0.1%)\n"
        f"  bounds at {res.confidence:g} confidence; {res.canaries} canaries, {res.steps} steps, "
        f"q = {res.sampling_probability:g}, σ = {res.noise_multiplier:g}"
        + ("" if res.actual_noise_multiplier == res.noise_multiplier else f" (run with σ = {res.actual_noise_multiplier:g})")
        + f", {res.seconds:.1f} s"
    )
    if not res.passed:  # print as main() would, then exit non-zero
        if args.json:
            print(json.dumps(_finite({k: v for k, v in out.items() if k != "text"}), indent=1, allow_nan=False))
        else:
            print(out["text"])
        sys.stdout.flush()
        raise SystemExit(AUDIT_FAILED)
    return out


# -- progress on stderr ----------------------------------------------------------------------


class _Progress:
    """A tqdm bar on stderr (silent when stderr is not a terminal, or tqdm is missing)."""

    def __init__(self, total: int, desc: str) -> None:
        self.bar = None
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, file=sys.stderr, disable=not sys.stderr.isatty(), leave=False)
        except ImportError:  # pragma: no cover - tqdm is a dependency
            pass

    def update_to(self, n: int) -> None:
        if self.bar is not None:
            self.bar.n = n
            self.bar.refresh()

    def __enter__(self) -> "_Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.close()


class _Spinner(_Progress):
    """A bar without a total, for work whose length is not known ahead (calibration)."""

    def __init__(self, desc: str) -> None:
        super().__init__(0, desc)


class _Text(str):
    """Output that is printed as is (the Markdown report)."""


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad argument reported on one line (exit code 2), without the usage."""

    def error(self, message: str) -> "Any":  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__, demo

    p = _Parser(prog="dpcore", description="Differentially private training, accounted.")
    p.add_argument("--version", action="version", version=f"dpcore {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--json", action="store_true", help="print one JSON object")

    def sampler_options(sp: argparse.ArgumentParser, allow_all: bool) -> None:
        g = sp.add_argument_group(
            "samplers (--sampler)",
            "Account the sampler the run actually uses (default poisson): truncated_poisson (Poisson at q, capped "
            "at --max-batch-size records of --population-size), balls_in_bins (each record in one of the epoch's "
            "1/q batches), random_allocation (each record in --num-selected k of every k/q steps), shuffle (a fresh "
            "permutation each epoch), sequential (a fixed order), cyclic (fixed batches cut once): these three without "
            "amplification." + (" all: every sampler side by side with Poisson." if allow_all else ""),
        )
        from .accounting.samplers import ACCOUNTED_SAMPLERS, NEIGHBORING

        g.add_argument("--sampler", choices=list(ACCOUNTED_SAMPLERS) + (["all"] if allow_all else []), default=None)
        g.add_argument("--neighboring", choices=list(NEIGHBORING), default=None,
                       help="the neighbouring relation ε is stated under (default: the sampler's own, add_or_remove "
                            "for the amplified samplers, zero_out for shuffle, sequential and cyclic; all: add_or_remove)")
        g.add_argument("--steps-per-epoch", type=_count("--steps-per-epoch"), metavar="K",
                       help="shuffle, sequential: steps in an epoch (default ceil(1/q)); cyclic: batches (floor(1/q))")
        g.add_argument("--population-size", type=_count("--population-size"), metavar="N")
        g.add_argument("--max-batch-size", type=_count("--max-batch-size"), metavar="B")
        g.add_argument("--num-selected", type=_count("--num-selected"), metavar="K", default=1)

    def mf_options(sp: argparse.ArgumentParser) -> None:
        g = sp.add_argument_group(
            "matrix factorization (--noise-mechanism banded|blt)",
            "Correlated noise (DP-FTRL): the records are cut once into B fixed batches (or groups) and batch "
            "t mod B is used at step t. -z is the effective noise multiplier z = σ/(S·sens(C)): with fixed "
            "batches ε is the Gaussian mechanism's at z whatever the strategy C; with -q P (cyclic Poisson "
            "sampling, each record of the group with probability P; banded C with at most B bands) ε is that "
            "of ceil(steps/B) Poisson-sampled Gaussian steps at P and z. --epochs E means E·B steps.",
        )
        g.add_argument("--noise-mechanism", choices=list(NOISE_MECHANISMS), default=None,
                       help="gaussian (default): DP-SGD's independent noise, sampled steps; banded, blt: the correlated "
                            "noise of a banded or BLT matrix factorization (-q with banded only)")
        # the old spelling, deprecated: dpsgd is gaussian, mf the --strategy file's kind (else banded)
        g.add_argument("--mechanism", choices=["dpsgd", "mf"], default=None, help=argparse.SUPPRESS)
        g.add_argument("--min-separation", type=_count("--min-separation"), metavar="B",
                       help="banded, blt: batches per epoch; a record takes part at most once every B steps")
        g.add_argument("--strategy", metavar="FILE",
                       help='banded, blt: a strategy as JSON (strategy.to_dict(), e.g. {"kind": "banded", "coefficients": '
                            '[1.0, 0.6, 0.2]} or {"kind": "blt", "theta": [...], "omega": [...]}): adds its '
                            "sensitivity and the noise stddev σ = z·S·sens to use")

    e = sub.add_parser("epsilon", help="ε of DP-SGD (or of a matrix-factorization mechanism, --noise-mechanism banded|blt) for a "
                       "sampling probability, noise multiplier and steps")
    e.add_argument("-q", "--sampling-probability", dest="q", type=_Q,
                   help="the sampling probability (required for DP-SGD; for banded: cyclic Poisson sampling)")
    e.add_argument("-z", "--noise-multiplier", dest="z", type=_Z, required=True)
    e.add_argument("--steps", type=_count("--steps"))
    e.add_argument("--epochs", type=_epochs, help="instead of --steps: ceil(epochs·k) steps, k the sampler's epoch (Poisson: round(1/q); banded, blt: B)")
    e.add_argument("--delta", type=_DELTA, required=True)
    e.add_argument("--accountant", choices=["pld", "rdp"], default=None,
                   help="default: pld, or the tightest certified accountant of --sampler")
    sampler_options(e, allow_all=True)
    mf_options(e)
    user_level_options(e, _count)
    common(e)

    c = sub.add_parser("calibrate", help="the noise multiplier, sampling probability or steps for a target ε "
                       "(--noise-mechanism banded|blt: the effective noise multiplier of a matrix-factorization mechanism)")
    c.add_argument("--epsilon", type=_EPS, required=True)
    c.add_argument("--delta", type=_DELTA, required=True)
    c.add_argument("-q", "--sampling-probability", dest="q", type=_Q)
    c.add_argument("-z", "--noise-multiplier", dest="z", type=_Z)
    c.add_argument("--steps", type=_count("--steps"))
    c.add_argument("--epochs", type=_epochs)
    c.add_argument("--accountant", choices=["pld", "rdp"], default=None,
                   help="default: pld, or the tightest certified accountant of --sampler")
    sampler_options(c, allow_all=False)
    mf_options(c)
    user_level_options(c, _count)
    common(c)

    r = sub.add_parser("report", help="the privacy report of a ledger (Ponomareva et al. 2023, §5.3.3)")
    r.add_argument("ledger", nargs="?")
    r.add_argument("--study", metavar="DIR_OR_FILE",
                   help="instead of a ledger: a hyperparameter-tuning study (a directory of run ledgers, or a study.json), "
                        "accounted with its tuning (Papernot & Steinke 2022) and by composition")
    r.add_argument("--delta", type=_DELTA, required=True)
    r.add_argument("--format", choices=["markdown", "json"], default="markdown")
    r.add_argument("--neighboring", choices=["add_or_remove", "zero_out", "replace_one"], default=None,
                   help="default: the relation of the run (zero_out when it used shuffled, fixed-order or fixed "
                        "batches, else add_or_remove)")
    r.add_argument("--accountant", choices=["pld", "rdp"], default="pld")
    common(r)

    pl = sub.add_parser("plot", help="ε against steps (PLD and RDP) as a PNG; needs dpcore[plot]")
    pl.add_argument("ledger")
    pl.add_argument("--delta", type=_DELTA, required=True)
    pl.add_argument("-o", "--output", default="epsilon.png")
    pl.add_argument("--points", type=_count("--points", 2), default=200)
    common(pl)

    au = sub.add_parser(
        "audit", help="one-run privacy audit of the mechanism (Steinke, Nasr & Jagielski 2023; f-DP analysis of "
        "Mahloujifar, Melis & Chaudhuri 2025); exit code 3 when a lower bound exceeds the claim",
        epilog=f"Exit codes: 0 the audit passed, {AUDIT_FAILED} it failed (a lower bound on ε exceeds the claimed ε; the "
        "result is printed first), 2 bad arguments, 1 other errors.")
    au.add_argument("-z", "--noise-multiplier", dest="z", type=_Z, required=True)
    au.add_argument("-q", "--sampling-probability", dest="q", type=_Q, default=0.5,
                    help="Poisson sampling rate of the canaries (1: every step; the claim is then μ-GDP)")
    au.add_argument("--steps", type=_count("--steps"), default=10)
    au.add_argument("--canaries", type=_count("--canaries", 10), default=100_000,
                    help="white-box gradient canaries, each in with probability 1/2 (O(canaries) per step)")
    au.add_argument("--actual-noise-multiplier", type=_Z, default=None,
                    help="run the mechanism with this noise instead of the claimed one (shows the audit's power)")
    au.add_argument("--delta", type=_DELTA, default=1e-5)
    au.add_argument("--confidence", type=_float("--confidence", 0.0, 1.0, True, True), default=0.95)
    common(au)

    d = sub.add_parser("demo", help="DP logistic regression on the digits data, with a non-private baseline")
    demo.add_arguments(d)
    common(d)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # exits with 2 on bad arguments
    if args.command == "demo":
        from . import demo

        if args.json:  # the results as one object; the demo's lines go to stderr
            res = demo.run(demo.from_args(args), out=sys.stderr)
            print(json.dumps(_finite(res), indent=1, allow_nan=False))
        else:
            demo.run(demo.from_args(args))
        return 0
    sub = parser._subparsers._group_actions[0].choices[args.command]  # type: ignore[union-attr]
    cmd = {"epsilon": _cmd_epsilon, "calibrate": _cmd_calibrate, "report": _cmd_report, "plot": _cmd_plot,
           "audit": _cmd_audit}[args.command]
    try:
        out = cmd(args, sub)
    except DataError as e:
        print(f"dpcore {args.command}: error: {e}", file=sys.stderr)
        return 1
    except (ValueError, OverflowError, RuntimeError) as e:  # a target no configuration meets, say
        print(f"dpcore {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"dpcore {args.command}: interrupted", file=sys.stderr)
        return 130
    if isinstance(out, _Text):
        print(out)
    elif getattr(args, "json", False) or args.command == "report":
        out = _finite({k: v for k, v in out.items() if k != "text"})
        print(json.dumps(out, indent=1, allow_nan=False))
    else:
        print(out["text"])
    return 0


def _finite(v: Any) -> Any:
    from .ledger._report import json_safe

    return json_safe(v)

if __name__ == "__main__":
    sys.exit(main())
