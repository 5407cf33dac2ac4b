"""The training program `orch up` runs by default: `python -m worker.train` under torchrun.

Modules: train (entry point), models, data and packed (input), pack (packing tool),
augment, optim (NovoGrad, lr schedules), folds (K-fold), checkpoint, metrics, distrib,
demo_data, compression (gradient communication hooks), hogwild (HOGWILD! on one host).
"""
