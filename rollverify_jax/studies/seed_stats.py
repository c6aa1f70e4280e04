"""Statistics over seeds that the report scripts share (compare.py, phenomenon.py): the mean and standard error
of per-run values, their "mean ± se" table cell, and Welch's t-test between two rows.
"""

from __future__ import annotations

import numpy as np


def mean_se(values: list[float]) -> tuple[float, float, int]:
    """Mean, standard error and count of the finite values (NaN entries, e.g. a run that never switched, are left
    out); the standard error of a single value is 0.0, of none NaN."""
    v = np.asarray([x for x in values if np.isfinite(x)], float)
    if not v.size:
        return float("nan"), float("nan"), 0
    return float(v.mean()), float(v.std(ddof=1) / np.sqrt(v.size)) if v.size > 1 else 0.0, int(v.size)


def cell(values: list[float], fmt: str, se_of_one: bool = False) -> str:
    """"mean ± se" in `fmt`, with "(n/N)" when only n of the N values are finite; "-" when none is. The "± se" part
    needs 2+ finite values, or with `se_of_one` (compare.py's tables) 2+ values of which one may be finite
    (then "± 0")."""
    m, se, n = mean_se(values)
    if not n:
        return "-"
    shown = len(values) if se_of_one else n
    return f"{m:{fmt}}" + (f" ± {se:{fmt}}" if shown > 1 else "") + (f" ({n}/{len(values)})" if n < len(values)
                                                                    else "")


def welch(a: list[float], b: list[float]) -> str:
    """Welch's two-sided t-test of `a` against `b`: "difference of means (t = .., p = ..)"."""
    from scipy import stats

    if len(a) < 2 or len(b) < 2:
        return "- (needs 2+ seeds each)"
    res = stats.ttest_ind(a, b, equal_var=False)
    return f"{np.mean(a) - np.mean(b):+.3f} (t = {res.statistic:.2f}, p = {res.pvalue:.3g})"
