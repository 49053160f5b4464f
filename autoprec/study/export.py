"""Write the policy of a (shared) study without the model: ``autoprec export``.

``tune`` records what a study needs to be read back on its own (study user attribute
``autoprec``): the variables (parameter name -> module paths), default, model name and
fingerprint, target, batch size and budget. Export picks the fastest trial feasible on
the calibration data — the rule tune uses — and writes its calibration error only
(``metrics.calibration_error``; ``metrics.error`` is the held-out figure tune confirms),
with a note that the eval-data confirmation was not repeated.
"""

from __future__ import annotations

import datetime as _dt
import math
from pathlib import Path
from typing import Any

import optuna
import torch

from autoprec._version import __version__
from autoprec.errors import InputError
from autoprec.formats.precisions import LEGACY_FORM
from autoprec.io.paths import check_not_an_input, check_out_path, storage_file
from autoprec.policy import Policy
from autoprec.search import select
from autoprec.search.decode import TrialDecoder
from autoprec.search.space import REGION, SearchSpace, Variable
from autoprec.study.driver import completed
from autoprec.study.storage import describe_storage, open_storage

META_KEY = "autoprec"

#: provenance.note of an exported policy: what export did not do.
EXPORT_NOTE = ("exported from the study: chosen on the calibration data; the eval-data "
               "confirmation was not repeated (run autoprec check MODEL.py --policy …)")


def study_meta(space: SearchSpace, **fields: Any) -> dict[str, Any]:
    """The study attribute tune writes (JSON-serialisable)."""
    return {
        "variables": {v.name: v.layers for v in space.variables},
        "choices": {v.name: v.choices for v in space.variables},
        "region_choices": space.region.choices,
        "reasons": space.reasons(),
        "locked": space.locked,
        **fields,
    }


def space_from_meta(meta: dict[str, Any]) -> SearchSpace:
    variables = [Variable(name, list(layers), list(meta.get("choices", {}).get(name, [])))
                 for name, layers in meta["variables"].items()]
    region = Variable(REGION, [""], list(meta.get("region_choices", ["fp32"])))
    return SearchSpace(variables, region, dict(meta.get("locked", {})))


def policy_from_candidate(space: SearchSpace, cand: select.Candidate, *, feasible: bool,
                          eval_error: float | None, meta: dict[str, Any],
                          provenance: dict[str, Any],
                          rules: tuple[str, dict[str, str]] | None = None,
                          confirmed: bool = True) -> Policy:
    """The policy file of one trial: its compact rules (``rules``, else the ones recorded
    on the trial, else an explicit rule on every layer: the same plan).

    ``metrics.error`` (``metric_drop`` with a metric) is the figure the budget binds: the
    eval-data error, or the calibration error when the eval data *is* the calibration data
    (``eval_error`` None). ``confirmed=False`` (an unconfirmed Pareto point, an export of a
    trial never measured on eval data) writes only ``calibration_error``.
    """
    default, layers = rules if rules is not None else TrialDecoder(space).rules(cand)
    reasons = {k: v for k, v in meta.get("reasons", space.reasons()).items()}
    metric_key = "metric_drop" if meta.get("budget_kind") == "max_drop" else "error"
    metrics: dict[str, Any] = {}
    if confirmed:
        err = cand.calib.error if eval_error is None else eval_error
        metrics[metric_key] = _num(err)
    metrics.update({
        f"calibration_{metric_key}": _num(cand.calib.error),
        "budget": meta.get("budget"),
        "est_speedup": round(cand.calib.est_speedup, 4),
        "feasible": feasible,
    })
    return Policy(
        default=default, layers=layers, form=meta.get("form", LEGACY_FORM),
        locked=list(meta.get("locked_paths", [])),
        reasons=reasons, metrics=metrics,
        model={"name": meta.get("model"), "fingerprint": meta.get("fingerprint")},
        target={"device": meta.get("target"), "batch_size": meta.get("batch_size")},
        provenance={**provenance, "trial": cand.number},
    )


def _num(x: float) -> float:
    """6 significant digits; an infinite error stays inf (YAML writes it as .inf)."""
    return float(f"{x:.6g}") if math.isfinite(x) else float(x)


def export_policy(storage: str, study_name: str, out: str | Path) -> tuple[Policy, bool]:
    """Choose from the study at ``storage`` and write the policy to ``out``."""
    check_out_path(Path(out))
    check_not_an_input(Path(out), {"the --storage study file": storage_file(storage)})
    if storage.startswith(("sqlite:///", "journal:")):  # reading: never create an empty store
        file = Path(storage.split("sqlite:///", 1)[-1] if storage.startswith("sqlite")
                    else storage.split("journal:", 1)[-1])
        if not file.is_file():
            raise InputError(f"{storage}: no such study storage file")
    store = open_storage(storage, Path(out).with_suffix(".db"))
    try:
        study = optuna.load_study(study_name=study_name, storage=store)
    except KeyError as err:
        raise InputError(f"{describe_storage(storage)}: no study named {study_name!r}") from err
    meta = study.user_attrs.get(META_KEY)
    if not meta:
        raise InputError(f"study {study_name!r} was not made by autoprec tune "
                         "(no 'autoprec' study attribute)")
    space = space_from_meta(meta)
    cands = completed(study)
    if not cands:
        raise InputError(f"study {study_name!r} has no completed trials yet")
    chosen, feasible = select.choose(cands, budget=float(meta["budget"]),
                                     min_speedup=meta.get("min_speedup"))
    provenance = {
        "autoprec": __version__, "torch": str(torch.__version__),
        "optuna": optuna.__version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "study": study_name, "storage": describe_storage(storage), "exported": True,
        "note": EXPORT_NOTE, "seed": meta.get("seed"), "data": meta.get("data"),
    }
    confirmed = chosen.eval_error is not None  # the search confirms within-budget trials
    if confirmed:
        provenance["note"] = (f"exported from the study: trial {chosen.number}, confirmed on "
                              "the eval data during the search")
    policy = policy_from_candidate(space, chosen, feasible=feasible,
                                   eval_error=chosen.eval_error, meta=meta,
                                   provenance=provenance, confirmed=confirmed)
    policy.save(Path(out))
    return policy, feasible
