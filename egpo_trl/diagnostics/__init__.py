"""Entropy diagnostics of evaluation records (``egpo-trl diagnose``): does the policy's uncertainty predict its errors?"""

from egpo_trl.diagnostics.metrics import (
    SCOPES,
    EntropyTable,
    bootstrap_gap_and_auc,
    entropy_table,
    roc_auc,
    roc_curve,
    scope_report,
)

__all__ = ["SCOPES", "EntropyTable", "bootstrap_gap_and_auc", "entropy_table", "roc_auc", "roc_curve"]
__all__ += ["scope_report"]
