"""The ``dpcore`` command line's options for the axes of a run, resolved into the plan's terms:
the summary of DP-SGD's ε, the noise mechanisms (``--noise-mechanism``, matrix-factorization
participation and strategy files) and the samplers (``--sampler``, ``--neighboring``). Kept
apart from :mod:`dpcore.cli`, which parses and dispatches the subcommands."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, Dict, List, Optional


class DataError(Exception):
    """Bad data (exit code 1), as opposed to bad arguments (exit code 2)."""


# -- argument types: each rejects a bad value with argparse's exit code 2 --------------------


def epsilon_summary(q: float, z: float, steps: int, delta: float, accountant: str = "pld") -> Dict[str, Any]:
    """ε of ``steps`` Poisson-subsampled Gaussian steps at ``delta``: under ``accountant``,
    with RDP and PLD (and the PLD lower bound) beside it."""
    from .accounting import PldAccountant, PoissonSampledEvent, GaussianEvent, SelfComposedEvent, epsilon

    pld = PldAccountant().compose(SelfComposedEvent(PoissonSampledEvent(q, GaussianEvent(z)), steps))
    lower, upper = pld.get_epsilon_bounds(delta)
    rdp = epsilon(q, z, steps, delta, accountant="rdp")
    main = upper if accountant == "pld" else rdp
    return {
        "epsilon": main,
        "accountant": accountant,
        "delta": delta,
        "sampling_probability": q,
        "noise_multiplier": z,
        "steps": steps,
        "epsilon_pld": upper,
        "epsilon_pld_lower_bound": lower,
        "epsilon_rdp": rdp,
    }


#: The values of --noise-mechanism that apply to the accounting commands (the discrete Gaussian
#: is a training-time choice, accounted from its ledger: ``dpcore report``).
NOISE_MECHANISMS = ("gaussian", "banded", "blt")
_MF = ("banded", "blt")


def _mf(args: argparse.Namespace) -> bool:
    return args.noise_mechanism in _MF


def _strategy_kind(path: Optional[str]) -> Optional[str]:
    """The ``kind`` of the strategy JSON at ``path`` if it can be read ("banded" or "blt"), else None."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            kind = json.load(f).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if kind in _MF else None


def _noise_mechanism(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``args.noise_mechanism`` resolved: the flag, or from the deprecated ``--mechanism dpsgd|mf``
    (mf: the kind of the ``--strategy`` file, else banded; ε does not depend on the strategy)."""
    old = getattr(args, "mechanism", None)
    if old is not None:
        new = "gaussian" if old == "dpsgd" else (_strategy_kind(args.strategy) or "banded")
        msg = f"--mechanism {old} is deprecated: it is --noise-mechanism {new} now"
        import warnings

        warnings.warn(msg, DeprecationWarning, stacklevel=2)
        print(f"dpcore {args.command}: warning: {msg}", file=sys.stderr)
        given = args.noise_mechanism
        if given is not None and (given in _MF) != (new in _MF):
            parser.error(f"give --noise-mechanism only (--mechanism {old} is its old form, and says {new})")
        args.noise_mechanism = given or new
    if args.noise_mechanism is None:
        args.noise_mechanism = "gaussian"
    if args.noise_mechanism == "blt" and args.q is not None:
        parser.error(
            "--noise-mechanism blt with -q (cyclic Poisson sampling): amplified matrix factorization needs a banded "
            "strategy with at most --min-separation bands (Choquette-Choo et al. 2023); use --noise-mechanism banded"
        )


def _participation(args: argparse.Namespace) -> Any:
    from .matrix_factorization import Participation

    if args.q is not None:
        return Participation.cyclic_poisson(args.min_separation, args.q)
    return Participation.cyclic(args.min_separation)


def _strategy(path: Optional[str], participation: Any, noise_mechanism: Optional[str] = None) -> Any:
    """The strategy in the JSON file ``path`` (None: none given), checked against the schema
    and against ``noise_mechanism`` (its kind)."""
    if path is None:
        return None
    from .matrix_factorization import strategy_from_dict

    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except OSError as e:
        raise DataError(f"{path}: {e.strerror or e}") from None
    except ValueError as e:
        raise DataError(f"{path}: not a JSON file: {e}") from None
    try:
        strategy = strategy_from_dict(d)
        kind = "blt" if type(strategy).__name__ == "BLTStrategy" else "banded"
        if noise_mechanism is not None and kind != noise_mechanism:
            raise ValueError(f"a {kind} strategy, but --noise-mechanism {noise_mechanism}: give --noise-mechanism {kind}")
        if participation.kind == "cyclic_poisson":
            strategy.check_cyclic_poisson(participation)
    except (TypeError, ValueError) as e:
        raise DataError(f"{path}: {e}") from None
    return strategy


def mf_summary(
    participation: Any, z: float, steps: int, delta: float, accountant: str = "pld", strategy: Any = None
) -> Dict[str, Any]:
    """ε of ``steps`` steps of a matrix-factorization mechanism at effective noise multiplier
    ``z`` (:func:`dpcore.matrix_factorization.epsilon`), with PLD, its lower bound and RDP beside
    it; with a ``strategy``, its sensitivity and the stddev per unit of clip norm σ/S = z·sens."""
    from .matrix_factorization import stddev_for

    p = participation.sampling_probability
    k = participation.participations(steps)
    # The composition the MF run is (see dpcore.matrix_factorization._accounting): one Gaussian
    # mechanism for fixed batches, k Poisson-sampled Gaussian participations for cyclic Poisson.
    out = epsilon_summary(1.0, z, 1, delta, accountant) if p is None else epsilon_summary(p, z, k, delta, accountant)
    out.update(
        mechanism="mf",
        noise_multiplier=z,
        steps=steps,
        sampling_probability=p,
        participation=participation.to_dict(),
        participation_schema=participation.describe(),
        participations=k,
    )
    if strategy is not None:
        sens = strategy.sensitivity(steps, participation)
        out.update(
            strategy=strategy.to_dict(),
            strategy_description=strategy.describe(),
            sensitivity=sens,
            stddev_per_unit_clip=stddev_for(z, 1.0, strategy, participation, steps),
        )
    return out


def _mf_text(out: Dict[str, Any]) -> str:
    k = out["participations"]
    text = f"{out['steps']} steps of matrix factorization, {out['participation_schema']} ({k} participation(s))"
    if "sensitivity" in out:
        text += (
            f"\n  strategy: {out['strategy_description']}; sensitivity {out['sensitivity']:.6g}; "
            f"noise stddev σ = {out['stddev_per_unit_clip']:.6g}·S (S the clip norm)"
        )
    return text


def _sampler_kw(args: argparse.Namespace, parser: argparse.ArgumentParser, sampler: str) -> Dict[str, Any]:
    """The keyword arguments of :func:`dpcore.accounting.sampler_event` for ``sampler``."""
    if sampler == "truncated_poisson" and (args.population_size is None or args.max_batch_size is None):
        parser.error("--sampler truncated_poisson needs --population-size and --max-batch-size")
    epochal = sampler in ("shuffle", "sequential", "cyclic")  # the samplers with an epoch of their own
    if args.steps_per_epoch is not None and not epochal:
        parser.error("--steps-per-epoch is an option of --sampler shuffle, sequential and cyclic")
    return {
        "sampling_probability": args.q,
        "population_size": args.population_size if sampler == "truncated_poisson" else None,
        "max_batch_size": args.max_batch_size if sampler == "truncated_poisson" else None,
        "num_selected": args.num_selected if sampler == "random_allocation" else 1,
        "neighboring": _relation(args, sampler),
        "steps_per_epoch": args.steps_per_epoch if epochal else None,
    }


def _relation(args: argparse.Namespace, sampler: str) -> str:
    """The relation asked for (``--neighboring``), else the sampler's default one."""
    from .sampling import sampler_class

    return args.neighboring or sampler_class(sampler).default_relation


def _check_sampler_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Optional[str]:
    """The sampler asked for (None: Poisson DP-SGD as before), its options checked."""
    sampler = getattr(args, "sampler", None)
    if sampler is None or sampler == "poisson":
        for flag in ("max_batch_size", "population_size"):
            if getattr(args, flag, None) is not None:
                parser.error(f"--{flag.replace('_', '-')} is an option of --sampler truncated_poisson (or all)")
        if getattr(args, "steps_per_epoch", None) is not None:
            parser.error("--steps-per-epoch is an option of --sampler shuffle, sequential and cyclic")
        if getattr(args, "neighboring", None) not in (None, "add_or_remove", "zero_out"):
            parser.error("Poisson sampling is analysed under --neighboring add_or_remove (or zero_out) only")
        if getattr(args, "num_selected", 1) != 1:
            parser.error("--num-selected is an option of --sampler random_allocation (or all)")
        return None
    if _mf(args):
        parser.error("--sampler is for DP-SGD; matrix-factorization mechanisms use cyclic schemas (--min-separation)")
    if args.q is None:
        parser.error("--sampler needs -q (the rate: q, or k/t and 1/b for the allocation samplers)")
    return sampler


def sampler_table(args: argparse.Namespace, parser: argparse.ArgumentParser, steps: int) -> Dict[str, Any]:
    """ε of the same (q, σ, steps) under every sampler that the arguments allow, beside
    Poisson's (``dpcore epsilon --sampler all``)."""
    from .accounting.samplers import ACCOUNTED_SAMPLERS, GUARANTEES, default_accountant, sampler_epsilon
    from .sampling import registered_samplers

    # one relation for the whole table: ε is never compared across relations
    relation = args.neighboring or "add_or_remove"
    args.neighboring = relation
    rows: List[Dict[str, Any]] = []
    # every sampler a run can select (sampler=...), then the accounted orders that are not one
    names = list(registered_samplers(selectable=True))
    names += [n for n in ACCOUNTED_SAMPLERS if n not in names]
    for name in names:
        if name == "truncated_poisson" and (args.population_size is None or args.max_batch_size is None):
            rows.append({"sampler": name, "error": "needs --population-size and --max-batch-size"})
            continue
        acct = default_accountant(name, args.accountant)
        try:
            eps = sampler_epsilon(name, args.z, steps, args.delta, accountant=acct, **_sampler_kw(args, parser, name))
        except ValueError as e:
            rows.append({"sampler": name, "error": str(e)})
            continue
        rows.append({"sampler": name, "epsilon": eps, "accountant": acct, "guarantee": GUARANTEES[name]})
    poisson = next((r.get("epsilon") for r in rows if r["sampler"] == "poisson"), None)
    lines = [f"ε at δ = {args.delta:g} after {steps} steps, q = {args.q:g}, σ = {args.z:g}, neighbouring relation "
             f"{relation}:"]
    for r in rows:
        if "error" in r:
            lines.append(f"  {r['sampler']:<18} n/a ({r['error']})")
            continue
        r["ratio_to_poisson"] = (r["epsilon"] / poisson if poisson > 0 else math.inf) if poisson is not None else None
        ratio = f"{r['ratio_to_poisson']:.3g}× Poisson" if r["ratio_to_poisson"] is not None else "Poisson n/a"
        lines.append(f"  {r['sampler']:<18} {r['epsilon']:<10.6g} ({r['accountant']}; {ratio}) {r['guarantee']}")
    return {"delta": args.delta, "steps": steps, "sampling_probability": args.q, "noise_multiplier": args.z,
            "neighboring": relation, "samplers": rows, "text": "\n".join(lines)}


# -- the privacy unit (--privacy-unit, --examples-per-user, --max-examples-per-user) ----------

#: What the user-level options of ``dpcore epsilon`` and ``calibrate`` resolve to.
ULS, ELS = "uls", "els"


def user_level_options(sp: argparse.ArgumentParser, count: Any) -> None:
    g = sp.add_argument_group(
        "privacy unit (--privacy-unit user)",
        "A guarantee for a user rather than one example. --examples-per-user k: user-level sampling (ULS): the "
        "sampler draws users (-q the rate of a user, --population-size the number of users), each contributing the "
        "clipped mean of at most k of its examples; the command is the ordinary one over the user population. "
        "--max-examples-per-user K: example-level sampling (ELS): each user's data bounded to at most K examples in "
        "total, examples Poisson-sampled at -q; the user is accounted as a mixture of Gaussians (Ganesh 2024) by "
        "PLD, with the group-privacy bound beside it as a cross-check.",
    )
    g.add_argument("--privacy-unit", choices=["example", "user"], default="example",
                   help="what one record is (default: example)")
    g.add_argument("--examples-per-user", type=count("--examples-per-user"), metavar="K",
                   help="ULS: each sampled user contributes the clipped mean of at most K examples per step")
    g.add_argument("--max-examples-per-user", type=count("--max-examples-per-user"), metavar="K",
                   help="ELS: each user's data bounded to at most K examples in total (Poisson sampling, PLD)")


def check_privacy_unit(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Optional[str]:
    """:data:`ULS`, :data:`ELS` or None (example level), the combination checked."""
    k, kk = getattr(args, "examples_per_user", None), getattr(args, "max_examples_per_user", None)
    if getattr(args, "privacy_unit", "example") != "user":
        if k is not None or kk is not None:
            flag = "--examples-per-user" if k is not None else "--max-examples-per-user"
            parser.error(f"{flag} bounds a user's contribution: it needs --privacy-unit user")
        return None
    if (k is None) == (kk is None):
        parser.error("--privacy-unit user takes exactly one of --examples-per-user K (user-level sampling: users are "
                     "the records) and --max-examples-per-user K (example-level sampling, a user bounded to K examples)")
    if k is not None:
        return ULS
    if _mf(args):
        parser.error("--max-examples-per-user is accounted for DP-SGD's independent Gaussian noise, not for "
                     "--noise-mechanism banded|blt")
    if getattr(args, "sampler", None) not in (None, "poisson"):
        parser.error(f"--max-examples-per-user (example-level sampling with a user-level guarantee) is accounted for "
                     f"Poisson sampling only, got --sampler {args.sampler}; use --examples-per-user for user-level "
                     "sampling with another sampler")
    if getattr(args, "accountant", None) == "rdp":
        parser.error("--max-examples-per-user is accounted by PLD only (no Rényi bound of the mixture of Gaussians "
                     "is implemented): drop --accountant rdp")
    if args.q is None:
        parser.error("--max-examples-per-user needs -q (the rate at which each example is sampled)")
    return ELS


def els_summary(q: float, z: float, steps: int, delta: float, k: int) -> Dict[str, Any]:
    """User-level ε of ``steps`` ELS steps (examples Poisson-sampled at ``q``, each user's data
    bounded to ``k`` examples, noise ``z``): the mixture-of-Gaussians PLD with its lower bound,
    and beside it the example-level ε of the same run and the group-privacy bound (looser)."""
    from .accounting import PldAccountant, group_privacy_epsilon
    from .events import GaussianEvent, PoissonSampledEvent, SelfComposedEvent
    from .plan import els_event

    lower, upper = PldAccountant().compose(els_event(z, steps, q, k)).get_epsilon_bounds(delta)
    example = SelfComposedEvent(PoissonSampledEvent(q, GaussianEvent(z)), steps)
    return {
        "epsilon": upper,
        "accountant": "pld",
        "delta": delta,
        "privacy_unit": "user",
        "max_examples_per_user": k,
        "sampling_probability": q,
        "noise_multiplier": z,
        "steps": steps,
        "epsilon_pld_lower_bound": lower,
        "epsilon_example_level": PldAccountant().compose(example).get_epsilon(delta),
        "epsilon_group_privacy": group_privacy_epsilon(example, k, delta),
    }


def els_text(out: Dict[str, Any]) -> str:
    k = out["max_examples_per_user"]
    return (
        f"  each user's data bounded to at most {k} examples in total; examples Poisson-sampled at q = "
        f"{out['sampling_probability']:g}; accounted as a mixture of Gaussians (Ganesh 2024)\n"
        f"  example-level ε of the same run {out['epsilon_example_level']:.6g}; group privacy over {k} examples "
        f"(k·ε, a looser cross-check) {out['epsilon_group_privacy']:.6g}"
    )


def uls_note(out: Dict[str, Any], k: int) -> Dict[str, Any]:
    """The ordinary command's output, stated for a user (ULS: users are the records)."""
    out["privacy_unit"] = "user"
    out["examples_per_user"] = k
    text = out["text"]
    text = text.replace("ε =", "user-level ε =", 1) if "ε =" in text else "user-level " + text
    out["text"] = (
        text
        + f"\n  user-level sampling: -q is the rate of a user and the population is the users; each sampled user "
        f"contributes the clipped mean of at most {k} examples per step"
    )
    return out
