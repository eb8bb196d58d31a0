"""The model at run time, without torch: the model-file contract, the predictor, the localiser,
the bundled models, calibration, flags and the adapted head."""
