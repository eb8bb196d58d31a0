"""Adapting the network to a new event: fine-tuning on an analyst's labels, and FixMatch on the
event's unlabelled buildings (PyTorch, imported inside the functions)."""
