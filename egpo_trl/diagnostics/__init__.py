"""Entropy diagnostics of evaluation records: does the policy's uncertainty predict its errors?

The command line is ``egpo-trl diagnose`` (:mod:`egpo_trl.diagnostics.cli`). The numbers come from
:mod:`~egpo_trl.diagnostics.metrics` (entropy per segment, ROC-AUC, bootstrap) and the figures from
:mod:`~egpo_trl.diagnostics.plots`.
"""

from egpo_trl.diagnostics.metrics import (
    SCOPES,
    EntropyTable,
    bootstrap_gap_and_auc,
    entropy_table,
    roc_auc,
    roc_curve,
    scope_report,
)

__all__ = [
    "SCOPES",
    "EntropyTable",
    "bootstrap_gap_and_auc",
    "entropy_table",
    "roc_auc",
    "roc_curve",
    "scope_report",
]
