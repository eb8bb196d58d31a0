"""Evaluation metrics: per-building classification scores, calibration of the class
probabilities and representation-space geometry (the xView2 challenge's pixel score is
:mod:`data_prep.xview2`'s).

NumPy, SciPy and scikit-learn only (matplotlib inside the plot functions): no torch, so the
ONNX-based evaluation path can use them.
"""

from runtime.metrics.calibration import (
    ECE_BINS,
    brier_score,
    calibration_metrics,
    ece_sampling_floor,
    expected_calibration_error,
    negative_log_likelihood,
    plot_reliability_diagram,
    reliability_bins,
)
from runtime.metrics.classification import (
    classification_metrics,
    macro_f1_present,
    plot_confusion_matrix,
    present_class_f1,
)
from runtime.metrics.representation import (
    class_alignment_consistency,
    class_alignment_distance,
    class_mean_gram,
    gaussian_potential_uniformity,
    gram_of_sums,
    gram_summary,
    representation_metrics,
    sample_alignment_accuracy,
    sample_alignment_distance,
    unit_rows,
)
from runtime.metrics.tsne import CLASS_COLOURS, plot_embedding_tsne

__all__ = [
    "CLASS_COLOURS",
    "ECE_BINS",
    "brier_score",
    "calibration_metrics",
    "ece_sampling_floor",
    "expected_calibration_error",
    "negative_log_likelihood",
    "plot_reliability_diagram",
    "reliability_bins",
    "class_alignment_consistency",
    "class_alignment_distance",
    "class_mean_gram",
    "classification_metrics",
    "gaussian_potential_uniformity",
    "gram_of_sums",
    "gram_summary",
    "macro_f1_present",
    "plot_confusion_matrix",
    "present_class_f1",
    "plot_embedding_tsne",
    "representation_metrics",
    "sample_alignment_accuracy",
    "sample_alignment_distance",
    "unit_rows",
]
