"""The pieces of ``egpo-trl train`` (:mod:`egpo_trl.train`): arguments, data, callbacks, outputs, plots, resume, run."""
