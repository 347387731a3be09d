"""The pieces of ``egpo-trl train`` (the command itself is :mod:`egpo_trl.train`), one concern per module.

* :mod:`~egpo_trl.script.outputs`: the files a run writes into ``output_dir`` and the check for an earlier run,
* :mod:`~egpo_trl.script.resolve`: what a recipe's model and reward-function names point to,
* :mod:`~egpo_trl.script.args`: :class:`TrainScriptArguments`, the model config, the parser and its checks,
* :mod:`~egpo_trl.script.help`: the short ``--help`` (``--help-all`` lists every field),
* :mod:`~egpo_trl.script.data`: the training and held-out sets and their ``prompt``/``answer`` columns,
* :mod:`~egpo_trl.script.callbacks`: ``metrics.jsonl`` and the compact progress bar,
* :mod:`~egpo_trl.script.resume`: Ctrl-C's checkpoint, the resume command, the metrics cut back on resume,
* :mod:`~egpo_trl.script.plots`: ``training_curves.png``,
* :mod:`~egpo_trl.script.run`: one run from resolved arguments (held-out check, training, outputs).

Each module imports only modules listed above it, and none imports :mod:`egpo_trl.train` or
:mod:`egpo_trl.launch` (both are built on these).
"""
