"""The PyTorch side of evaluation: the scorer of a run folder and the augmented second view
(:mod:`~local_damage.evaluation.torch_scorer`); everything else of evaluation is torch-free and
lives in :mod:`runtime.evaluation`.
"""
