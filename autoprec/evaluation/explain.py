"""A ``Decision`` in words: the reason line tune and eval print (and their JSON carries).

``render`` joins the words of each reason in the decision's order: the main rule first,
then the timing step's second looks in brackets, then what a tune wrote instead. The
search's pick by estimate has no words of its own: the table shows its row.
"""

from __future__ import annotations

from autoprec.evaluation.decision import (
    ByEstimate,
    ColdConfirmed,
    Decision,
    EstimatedInstead,
    MeasuredFastest,
    NothingMeasured,
    NotMeasured,
    PageFaults,
    Reason,
    Retimed,
    SimplerTie,
    Timed,
    TunedSlower,
    WroteInstead,
)


def _spread(t: Timed) -> str:
    return f"{t.speedup:.2f}x (p10-p90 {t.p10:.2f}-{t.p90:.2f}x)"


def words(reason: Reason) -> str:
    """One reason's words, with the separator that joins it to the ones before."""
    match reason:
        case ByEstimate():
            return ""
        case NotMeasured(note=note):
            return note
        case EstimatedInstead(row=row):
            return (f"; {row} is estimated faster than the tuned plan (or is the fastest "
                    "plan within budget): wrote it")
        case NothingMeasured():
            return "nothing within budget was measured"
        case MeasuredFastest(winner=w, runner_up=r):
            runner = "" if r is None else f"; next {r.name} {r.speedup:.2f}x"
            return (f"{w.name} measured {w.speedup:.2f}x over fp32 (p10-p90 {w.p10:.2f}-"
                    f"{w.p90:.2f}x), the fastest within budget{runner}")
        case SimplerTie(winner=w, fastest=f):
            more = ("" if w.rules < f.rules else
                    f" (it holds {w.weight_bytes / 1e6:.1f} MB of weights, "
                    f"{f.name} {f.weight_bytes / 1e6:.1f} MB)")
            return (f"{w.name} ({w.rules} rules) measured {_spread(w)}, {f.name} ({f.rules} "
                    f"rules) {_spread(f)}: as fast within the noise, the simpler plan is "
                    f"written{more}")
        case TunedSlower():
            t = reason.tuned
            if t.speedup is None:
                why = f"{t.name} could not be timed ({reason.tuned_why_not or 'not runnable'})"
            else:
                est = "" if reason.tuned_est is None else f" (est. {reason.tuned_est:.2f}x)"
                over = "" if reason.tuned_feasible else ", over budget,"
                why = f"{t.name}{est}{over} measured {t.speedup:.2f}x over fp32"
            tie = ("; their p10-p90 overlap: as fast within the noise, the faster median is "
                   "kept" if reason.overlap else "")
            return f"{why}, slower than {reason.winner.name} at {_spread(reason.winner)}{tie}"
        case Retimed():
            return (f" [re-timed {', '.join(reason.rows)}: {reason.faster} first measured "
                    f"{reason.faster_first:.2f}x against {reason.slower}'s "
                    f"{reason.slower_first:.2f}x, the estimate {reason.faster_est:.2f}x vs "
                    f"{reason.slower_est:.2f}x; "
                    + ("still contradicted: the measurement stands]" if reason.still
                       else "the second timing no longer contradicts the estimate]"))
        case ColdConfirmed():
            moved = [f"{m.name} {m.warm:.2f}x -> {m.cold:.2f}x"
                     + (f" ({m.faults:,.0f} faults per forward)" if m.faults else "")
                     for m in reason.moved]
            return (f" [{reason.winner} casts its weights on every call: "
                    f"{', '.join(reason.rows)} timed again with the allocator trimmed before "
                    "each forward (fresh pages: benchmarks/results/page_faults.md); each row keeps "
                    "its slower state" + (f": {'; '.join(moved)}]" if moved else
                                          ": none slower]"))
        case PageFaults(rows=rows):
            each = ", ".join(f"{name} {faults:,.0f}" for name, faults in rows)
            return (f" [page faults per timed call (a forward, or a training step): {each}. "
                    "These calls touch memory the "
                    "allocator got fresh from the OS (glibc returns large freed buffers, "
                    "such as per-call weight casts); another process, or another allocator, "
                    "may run them without the faults]")
        case WroteInstead(row=row):
            return f": wrote {row} instead"
    raise TypeError(f"no words for {type(reason).__name__}")


def render(decision: Decision) -> str:
    """The decision's reason line."""
    return "".join(words(r) for r in decision.reasons)


__all__ = ["render", "words"]
